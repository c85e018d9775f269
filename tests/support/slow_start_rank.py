"""A rank for tests/test_fault_campaign.py's start-up checks, run by examples/launch.py's launch_ranks.

argv[1] is JSON: {"delay_s": {"<rank>": seconds}} slows that rank's start (as a loaded machine
slows imports) before it joins the process group; "hang_after_start": true blocks every rank
forever once the group is up and one collective has run (a hang of the product, not of start-up).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from launch import init_process_group_reporting_start  # noqa: E402


def main() -> None:
    params = json.loads(sys.argv[1])
    time.sleep(params.get("delay_s", {}).get(os.environ["RANK"], 0.0))
    init_process_group_reporting_start("gloo", timedelta(seconds=30))
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == dist.get_world_size()
    print(f"STARTED rank {dist.get_rank()}", flush=True)
    if params.get("hang_after_start"):
        threading.Event().wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
