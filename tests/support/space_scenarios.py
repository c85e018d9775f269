"""The free-space check before a RAM save, run on several gloo ranks by tests/test_space.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core.space import check_room_on_every_rank
from tests.support.multiproc import expect_failure, scenario_main


def full_node_skips_the_save_everywhere(p: dict[str, Any]) -> None:
    """Each rank has its own base (its node); only rank 1's tmpfs is full: every rank must raise, none hang."""
    expect_failure(lambda: check_room_on_every_rank(p["bases"][dist.get_rank()]), "SKIPPED")


if __name__ == "__main__":
    scenario_main({"full_node_skips_the_save_everywhere": full_node_skips_the_save_everywhere})
