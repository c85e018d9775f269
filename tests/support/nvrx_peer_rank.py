"""One rank of the peer check: NVRx 0.4.1's basic local-manager scenarios against our manager.

The scenarios of NVRx's tests/checkpointing/unit/test_basic_local.py (save and load without a restart,
load after a restart, no version after each rank lost its file, several saves), written here for our
manager's interface; each rank writes what it saw to <out>/peer-rank-<rank>.json. --root: one
directory per (root, async) case is made under each root given, in a subdirectory that does not exist yet.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from ml_flashpoint_nemo.core import committed_steps  # noqa: E402
from ml_flashpoint_nemo.core.layout import object_name  # noqa: E402
from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager as Manager  # noqa: E402
from tests.support.nvrx_peer_states import PlainTensorState  # noqa: E402


def saved(manager: Manager, state: PlainTensorState, iteration: int, is_async: bool) -> None:
    """NVRx's pattern: with is_async, run the returned request synchronously (its function, then finalize)."""
    request = manager.save(state, iteration, is_async)
    if is_async:
        assert request is not None
        request.execute_sync()
    else:
        assert request is None


def committed_now(manager: Manager) -> list[int]:
    """The committed versions once every rank returned from its save, before any starts the next one (whose
    start retires what it supersedes on the node's shared directory)."""
    dist.barrier()
    steps = committed_steps(manager.layout)
    dist.barrier()
    return steps


def scenario(root: Path, is_async: bool) -> dict:
    rank = dist.get_rank()
    seen: dict = {}
    manager = Manager(root)  # root does not exist yet
    state = PlainTensorState(1)
    saved(manager, state, 1, is_async)
    seen["latest_without_restart"] = manager.find_latest()
    loaded, ckpt_id = manager.load()
    seen["equal_without_restart"] = loaded == state
    seen["id_without_restart"] = list(ckpt_id)
    manager.close()

    manager = Manager(root)  # a restart: a new manager on the same directory
    seen["latest_after_restart"] = manager.find_latest()
    loaded, ckpt_id = manager.load()
    seen["equal_after_restart"] = loaded == PlainTensorState(1)
    seen["id_after_restart"] = list(ckpt_id)
    manager.close()

    manager = Manager(root)  # each rank loses its own object of the only version
    dist.barrier()
    manager.layout.object_path(1, object_name(rank)).unlink()
    dist.barrier()
    seen["latest_after_loss"] = manager.find_latest()

    saved(manager, PlainTensorState(1), 1, is_async)  # several saves
    saved(manager, PlainTensorState(2), 2, is_async)
    seen["committed_after_two_saves"] = committed_now(manager)
    saved(manager, PlainTensorState(3), 3, is_async)
    seen["committed_after_three_saves"] = committed_now(manager)
    seen["latest_after_saves"] = manager.find_latest()
    loaded, _ = manager.load()
    seen["equal_after_saves"] = loaded == PlainTensorState(3)
    manager.close()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", action="append", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for number, root in enumerate(args.root):
        for is_async in (True, False):
            case = f"root{number}-{'async' if is_async else 'sync'}"
            results[case] = scenario(Path(root, case, "subdir"), is_async)
    Path(args.out, f"peer-rank-{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
