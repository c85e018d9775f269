"""The gather that learns each node's failure domain, on real gloo ranks (run by tests/test_failure_domains.py).

Every rank shares one base directory (one node); each case sets the ranks' domains and prints
what discover_nodes returned or raised on this rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core.topology import FAILURE_DOMAIN_ENV, discover_nodes
from ml_flashpoint_nemo.errors import FailureDomainError
from tests.support.multiproc import scenario_main


def _discovered(label: str, base: str, env: list[str | None], source: Callable[[], str | None] | None = None) -> None:
    value = env[dist.get_rank()]
    if value is None:
        os.environ.pop(FAILURE_DOMAIN_ENV, None)
    else:
        os.environ[FAILURE_DOMAIN_ENV] = value
    try:
        topology = discover_nodes(base, source)
    except FailureDomainError as exc:
        print(f"{label} {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"{label} {topology.domain_of_node} {topology.node_count} node", flush=True)
    dist.barrier()  # every rank got here: none was left waiting in the gather


def discover(p: dict[str, Any]) -> None:
    base = p["base"]
    os.makedirs(base, exist_ok=True)

    def unreadable() -> str:
        if dist.get_rank() == 0:
            raise OSError("the host's rack label file is unreadable")
        return "rack-1"

    _discovered("AGREED", base, ["rack-1", "rack-1"])
    _discovered("DISAGREED", base, ["rack-1", "rack-2"])
    _discovered("MALFORMED", base, ["rack-1", "rack 1"])
    _discovered("CALLABLE", base, [None, None], unreadable)
    _discovered("UNNAMED", base, [None, ""])


if __name__ == "__main__":
    scenario_main({"discover": discover})
