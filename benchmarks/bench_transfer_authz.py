"""Cost of per-rank authorization and transfer bounds: pushes to a server with the replication policy vs none.

Prints one JSON object. Both servers run in this process on the same kind of tmpfs directory:

- policy: what the replication service runs (TransferPolicy from replication.service.transfer_policy,
  the minimum rate, space reservation);
- open: no policy and no minimum rate (space reservation cannot be turned off; protocol v3 handshake
  in both).

Two workloads, alternated round by round (open then policy, then policy then open, ...) so drift
on a shared machine hits both alike: many small pushes (one connection, handshake and policy decision each: the
per-request cost) and a few large pushes with a known CRC (the per-byte cost). Wall and process
CPU seconds (every thread of this process: client and server) are reported per push; ratios are
policy / open of the medians (ratio_*) and of the best rounds (ratio_best_*: on a loaded machine a
round's median is mostly scheduling noise for the small pushes).

    python benchmarks/bench_transfer_authz.py [--small 200] [--mib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name, version_relpath
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.replication.service import transfer_policy

SECRET = b"bench-authz-secret-0123456789abcdef"
HOST = "127.0.0.1"
JOB = NodeTopology((0, 1), rank=1)  # the server is rank 1 on node 1; rank 0 replicates to it
SENDER, RECEIVER = 0, 1


def _saved_here(base: Path, step: int) -> None:
    """The receiving node's own save of step has begun (its rank's object is there): pushes of step are due."""
    own = base / version_relpath(step, object_name(RECEIVER))
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_bytes(b"the receiving rank's own object")


def _push_round(port: int, fd: int, offset: int, nbytes: int, crc: int, count: int, step: int) -> tuple[float, float]:
    """Pushes [offset, offset + nbytes) of fd count times as rank 0's objects of step; (wall, CPU) s per push."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        _core.transfer_push_fd(HOST, port, SECRET, fd, version_relpath(step, object_name(SENDER, i)), offset=offset,
                               length=nbytes, crc32c=crc, rank=SENDER, peer_rank=RECEIVER, retries=0)
    return (time.perf_counter() - wall) / count, (time.process_time() - cpu) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=200, help="small (1 KiB) pushes per round")
    parser.add_argument("--mib", type=int, default=64, help="size of each large push")
    parser.add_argument("--large", type=int, default=3, help="large pushes per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="flashpoint-bench-authz-", dir="/dev/shm"))
    try:
        source = root / "source"
        small, large = os.urandom(1024), os.urandom(1 << 20) * args.mib
        source.write_bytes(small + large)
        crcs = {"small": _core.crc32c(small), "large": _core.crc32c(large)}
        bases = {"open": root / "open", "policy": root / "policy"}
        for base in bases.values():
            base.mkdir()
        results: dict[str, list[float]] = {f"{k}_{w}_{m}": [] for k in bases for w in ("small", "large")
                                           for m in ("wall", "cpu")}
        with _core.TransferServer(bases["open"], SECRET, rank=RECEIVER, min_rate_bytes_per_s=0) as open_server, \
                _core.TransferServer(bases["policy"], SECRET, rank=RECEIVER,
                                     policy=transfer_policy(JOB, factor=2)) as policy_server, \
                open(source, "rb") as f:
            servers = {"open": open_server, "policy": policy_server}
            workloads = {"small": (0, len(small), crcs["small"], args.small),
                         "large": (len(small), len(large), crcs["large"], args.large)}
            for step in range(args.rounds):
                for kind in ("open", "policy") if step % 2 == 0 else ("policy", "open"):  # each goes first alike
                    for workload, (offset, nbytes, crc, count) in workloads.items():
                        _saved_here(bases[kind], step)
                        wall, cpu = _push_round(servers[kind].port, f.fileno(), offset, nbytes, crc, count, step)
                        results[f"{kind}_{workload}_wall"].append(wall)
                        results[f"{kind}_{workload}_cpu"].append(cpu)
                        shutil.rmtree(CheckpointLayout(bases[kind]).version_dir(step))
            assert policy_server.stats()["forbidden"] == 0 and open_server.errors() == [] == policy_server.errors()
        medians = {key: statistics.median(values) for key, values in results.items()}
        bests = {key: min(values) for key, values in results.items()}
        measures = [f"{w}_{m}" for w in ("small", "large") for m in ("wall", "cpu")]
        report = {
            "load_average": os.getloadavg(),
            "small_pushes_per_round": args.small, "large_mib": args.mib, "rounds": args.rounds,
            **{f"median_{key}_s": value for key, value in medians.items()},
            **{f"best_{key}_s": value for key, value in bests.items()},
            **{f"ratio_{m}_policy_vs_open": medians[f"policy_{m}"] / medians[f"open_{m}"] for m in measures},
            **{f"ratio_best_{m}_policy_vs_open": bests[f"policy_{m}"] / bests[f"open_{m}"] for m in measures},
        }
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
