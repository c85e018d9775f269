"""Replication benchmark: push throughput of the replication service vs raw TCP, and training slowdown.

Same run, same machine, loopback:
- raw TCP: `references.raw_tcp_throughput` (two Python threads, sendall()/recv_into() of preallocated
  buffers, on one loopback connection: the kernel's TCP, benchmarks/references.py);
- replication: ReplicationService's background thread pushing one committed version (one object of
  --mib MiB) to a peer's TransferServer (handshake, CRC32C both ends, tmpfs write, fsync, rename),
  timed from replicate(step) to the status turning "replicated";
- training slowdown: a matmul loop (a stand-in for training steps) timed alone and while a
  replication of the same object runs in the background.

    python benchmarks/bench_replication.py [--mib 512] [--repeats 3] [--json]

Budget (DESIGN.md section 8): replication over loopback >= 0.7x raw TCP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.core.versions import write_commit
from ml_flashpoint_nemo.replication.service import PeerEndpoints, ReplicationConfig, ReplicationService

from references import raw_tcp_throughput

SECRET = os.urandom(32)


def _write_object(layout: CheckpointLayout, step: int, nbytes: int) -> None:
    directory = layout.version_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with open(directory / object_name(0), "wb") as handle:
        for offset in range(0, nbytes, len(block)):
            handle.write(block[: min(len(block), nbytes - offset)])
    write_commit(layout, step, [ObjectRecord(object_name(0), 0, nbytes, 0)], world_size=2)


def _matmul_loop(steps: int, size: int = 384) -> float:
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    started = time.perf_counter()
    for _ in range(steps):
        a = torch.tanh(a @ b)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    root = tempfile.mkdtemp(prefix="flashpoint-bench-replication-", dir="/dev/shm")
    torch.set_num_threads(1)
    try:
        sender, receiver = CheckpointLayout(os.path.join(root, "node-0")), CheckpointLayout(os.path.join(root, "node-1"))
        receiver.base_dir.mkdir(parents=True)
        steps = list(range(1, 2 * args.repeats + 2))
        for step in steps:
            _write_object(sender, step, nbytes)
        server = _core.TransferServer(os.fspath(receiver.base_dir), SECRET, host="127.0.0.1", port=0, rank=1)
        endpoints = PeerEndpoints(server, SECRET, [None, ("127.0.0.1", server.port)], rank=0)
        service = ReplicationService(sender.base_dir, NodeTopology((0, 1), rank=0), ReplicationConfig(), endpoints)
        raw, pushed, train_alone, train_during = [], [], [], []
        step_iter = iter(steps)
        try:
            _matmul_loop(20)  # warm-up
            for _ in range(args.repeats):
                raw.append(raw_tcp_throughput(nbytes)["bytes_per_s"])
                step = next(step_iter)
                started = time.perf_counter()
                service.replicate(step)
                status = service.wait(step, timeout=600)
                assert status.replicated, status
                pushed.append(nbytes / (time.perf_counter() - started))
                train_alone.append(_matmul_loop(args.train_steps))
                step = next(step_iter)
                service.replicate(step)
                train_during.append(_matmul_loop(args.train_steps))
                status = service.wait(step, timeout=600)
                assert status.replicated, status
                overlapped = status.seconds
                train_during[-1] = (train_during[-1], overlapped)
        finally:
            service.close()
        raw_median = statistics.median(raw)
        push_median = statistics.median(pushed)
        alone = statistics.median(train_alone)
        during = statistics.median(t for t, _ in train_during)
        result = {
            "object_mib": args.mib,
            "repeats": args.repeats,
            "raw_tcp_gbps": round(raw_median / 1e9, 3),
            "replication_gbps": round(push_median / 1e9, 3),
            "replication_vs_raw_tcp": round(push_median / raw_median, 3),
            "budget_replication_vs_raw_tcp": 0.7,
            "train_loop_s_alone": round(alone, 4),
            "train_loop_s_with_replication": round(during, 4),
            "train_slowdown": round(during / alone, 3),
            "push_seconds_while_training": [round(s, 3) for _, s in train_during],
            "cpu_count": os.cpu_count(),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=None if args.json else 2))
    return result


if __name__ == "__main__":
    main()
