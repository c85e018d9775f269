"""Replication transport throughput over loopback: TransferServer push vs raw TCP, same run.

Prints one JSON object. The raw baseline is a plain C++ send()/recv() loop between two threads
of this process (`_core.raw_tcp_throughput`), the same language as the transfer service, so the
ratio measures what the protocol costs (handshake, CRC32C on both ends, writing a fresh tmpfs
file, fsync, rename), not Python. Runs alternate raw / push / push-without-sendfile so drift on
a shared machine hits all of them alike; medians and bests are reported, the ratio uses medians.

    python benchmarks/bench_replication_transport.py [--mib 512] [--repeats 5]

Design budget (DESIGN.md section 8): replication over loopback >= 0.7x raw TCP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from ml_flashpoint_nemo import _core

SECRET = b"bench-replication-secret-0123456789"


def _make_object(path: str, nbytes: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="object size in MiB (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs of each kind (default 5)")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs to put both base directories on")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20

    root = tempfile.mkdtemp(prefix="flashpoint-bench-xfer-", dir=args.dir)
    try:
        src_dir = os.path.join(root, "src")
        dst_dir = os.path.join(root, "dst")
        os.makedirs(os.path.join(src_dir, "step-1"))
        os.makedirs(dst_dir)
        _make_object(os.path.join(src_dir, "step-1", "rank-00000-0.fpo"), nbytes)
        results: dict[str, list[float]] = {"raw_tcp": [], "push_sendfile": [], "push_send": [], "fetch": []}
        with _core.TransferServer(dst_dir, SECRET, max_connections=2) as server:
            def push(zero_copy: bool) -> float:
                r = _core.transfer_push("127.0.0.1", server.port, SECRET, src_dir, "step-1/rank-00000-0.fpo",
                                        zero_copy=zero_copy, retries=0)
                assert r["nbytes"] == nbytes
                # The replica replaced by the next push would otherwise be freed inside it.
                os.unlink(os.path.join(dst_dir, "step-1", "rank-00000-0.fpo"))
                return nbytes / r["seconds"]

            def fetch() -> float:
                t0 = time.perf_counter()
                _core.transfer_fetch("127.0.0.1", server.port, SECRET, "step-1/rank-00000-0.fpo", src_dir,
                                     "step-1/fetched.fpo", retries=0)
                dt = time.perf_counter() - t0
                os.unlink(os.path.join(src_dir, "step-1", "fetched.fpo"))
                return nbytes / dt

            push(True)  # warm-up: page cache of the source, socket buffers, code paths
            _core.raw_tcp_throughput(nbytes)
            for _ in range(args.repeats):
                results["raw_tcp"].append(_core.raw_tcp_throughput(nbytes)["bytes_per_s"])
                results["push_sendfile"].append(push(True))
                results["push_send"].append(push(False))
                # The fetch needs the object on the serving side.
                shutil.copyfile(os.path.join(src_dir, "step-1", "rank-00000-0.fpo"),
                                os.path.join(dst_dir, "step-1", "rank-00000-0.fpo"))
                results["fetch"].append(fetch())
                os.unlink(os.path.join(dst_dir, "step-1", "rank-00000-0.fpo"))
            server_errors = server.errors()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def summary(values: list[float]) -> dict:
        return {"median_gb_per_s": round(statistics.median(values) / 1e9, 3),
                "best_gb_per_s": round(max(values) / 1e9, 3),
                "runs_gb_per_s": [round(v / 1e9, 3) for v in values]}

    raw = statistics.median(results["raw_tcp"])
    out = {
        "object_mib": args.mib,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "crc32c_backend": _core.crc32c_backend(),
        **{k: summary(v) for k, v in results.items()},
        "ratio_push_vs_raw": round(statistics.median(results["push_sendfile"]) / raw, 3),
        "ratio_push_send_vs_raw": round(statistics.median(results["push_send"]) / raw, 3),
        "ratio_fetch_vs_raw": round(statistics.median(results["fetch"]) / raw, 3),
        "ratio_best_push_vs_best_raw": round(max(results["push_sendfile"]) / max(results["raw_tcp"]), 3),
        "target_ratio": 0.7,
        "server_errors": server_errors,
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
