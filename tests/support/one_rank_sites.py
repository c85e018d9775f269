"""Helpers of the one-rank failure scenarios (tests/test_one_rank_sites.py): run cases, inject failures.

A world runs several independent cases in sequence; each case injects a local failure on one
rank only and prints one line per rank, "[case] <outcome> (<seconds>s)", then the ranks meet in
a barrier. A rank left waiting in a collective shows as a timeout of the whole world.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist

from tests.support.multiproc import scenario_main

Case = Callable[[Path], str]


def run_cases(cases: dict[str, Case], p: dict[str, Any]) -> None:
    """Run the cases named in p["cases"], each in its own directory under p["root"]."""
    for name in p["cases"]:
        root = Path(p["root"]) / name
        root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            outcome = cases[name](root)
        except Exception as exc:  # noqa: BLE001 - printed for the test
            outcome = f"RAISED {type(exc).__name__}: {exc}"
        outcome = outcome.replace("\n", "\\n")
        print(f"[{name}] {outcome} ({time.monotonic() - started:.1f}s)", flush=True)
        dist.barrier()


def cases_main(cases: dict[str, Case]) -> None:
    """A case module's entry point: its one scenario, "cases", runs the cases named in p["cases"] (run_cases)."""
    scenario_main({"cases": lambda p: run_cases(cases, p)})


def outcomes(outputs: list[str]) -> dict[str, list[str]]:
    """{case: [rank 0's outcome line, rank 1's, ...]} from the ranks' outputs."""
    found: dict[str, list[str]] = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("[") and "] " in line:
                name, _, rest = line[1:].partition("] ")
                found.setdefault(name, []).append(rest)
    return found


def seconds_of(line: str) -> float:
    return float(line.rsplit("(", 1)[1].rstrip("s)"))


@contextlib.contextmanager
def failing_on(rank: int, owner: Any, name: str, error: BaseException) -> Iterator[None]:
    """On `rank` only, owner.name raises error while the block runs (a local failure of that rank)."""
    if dist.get_rank() != rank:
        yield
        return
    had, original = name in vars(owner), vars(owner).get(name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise error

    setattr(owner, name, broken)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (or, for None, remove) environment variables while the block runs."""
    before = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def node_base(root: Path) -> Path:
    """This rank's own "node": a base directory of its own."""
    return root / f"node-{dist.get_rank()}"


def committed_on_two_nodes(root: Path, *, without_commit: bool = False, without_object_of: int | None = None) -> None:
    """Step 1, a DCP version of both ranks, committed in node-0's base and copied into node-1's.

    without_commit: node 1's copy lacks the commit record; without_object_of: it lacks that rank's object.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from ml_flashpoint_nemo.core.layout import COMMIT_NAME, rank_of_object
    from ml_flashpoint_nemo.dcp import MemoryStorageWriter

    source = root / "node-0"
    writer = MemoryStorageWriter(source)
    dcp.save({f"w{dist.get_rank()}": torch.ones(4) * dist.get_rank()}, checkpoint_id=os.fspath(source / "step-1"),
             storage_writer=writer)
    writer.close()
    dist.barrier()
    if dist.get_rank() == 1:
        copy = root / "node-1" / "step-1"
        shutil.copytree(source / "step-1", copy)
        if without_commit:
            (copy / COMMIT_NAME).unlink()
        if without_object_of is not None:
            for name in os.listdir(copy):
                if rank_of_object(name) == without_object_of:
                    (copy / name).unlink()
    dist.barrier()
