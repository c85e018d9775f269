"""Replication transport throughput over loopback: TransferServer push and fetch vs raw TCP, same run.

Prints one JSON object. The raw baseline is one loopback TCP connection between two threads of
this process (`references.raw_tcp_throughput`: sendall() of one preallocated chunk, recv_into()
one preallocated buffer; each call releases the GIL, so what it times is the kernel's TCP), so the
ratio measures what the protocol costs (handshake, CRC32C on the receiving end, writing the tmpfs
file, fsync, rename).

The source is a real object written by CheckpointSaver (tensors of several dtypes, an empty one,
odd sizes). Two figures are reported for each direction:

- steady (the keys without a suffix; ratio_push_vs_raw): the state of a running job. The sender
  passes the object's CRC32C derived from its index (core.format.whole_object_crc32c, timed as
  part of the push), so it only reads each chunk to tag it and sends it from that buffer
  (`push_sendfile`: with zero_copy, i.e. sendfile()); each received replica is then retired into
  the receiver's replica spare directory exactly as the replication service retires a version
  (replication.service.SpareFiles), so the next reception overwrites warm tmpfs pages.
- cold (`*_cold`): a first transfer: no known CRC (the sender reads and checksums every chunk)
  and no spare (the receiver faults in and zeroes fresh tmpfs pages).

Every message is tagged with AES-256-GMAC (protocol v3), computed by OpenSSL's libcrypto;
`tag_library` says which version ran.

Runs alternate raw / push / push with sendfile / cold push / fetch / cold fetch, so drift on a
shared machine hits all of them alike; medians and bests are reported, the ratios use medians.
`cpu_s_per_gb_*` is the process's CPU time (both ends, user + system) per GB moved: unlike the
throughput, it barely depends on what else runs on the machine.

    python benchmarks/bench_replication_transport.py [--mib 512] [--repeats 5]

Design budget (DESIGN.md section 8): replication over loopback >= 0.7x raw TCP.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import ObjectRecord, whole_object_crc32c
from ml_flashpoint_nemo.core.layout import REPLICA_SPARES, CheckpointLayout
from ml_flashpoint_nemo.core.saver import CheckpointSaver
from ml_flashpoint_nemo.replication.service import SpareFiles

from references import raw_tcp_throughput

SECRET = b"bench-replication-secret-0123456789"
STEP = 1
HOST = "127.0.0.1"


def _state_of(nbytes: int) -> dict[str, torch.Tensor]:
    """About nbytes of tensors: mostly large float32, plus bfloat16, int64 of an odd size and an empty one."""
    big = max(1, nbytes // 4 - (1 << 20))
    per_tensor = big // 4
    state = {f"layer{i}.weight": torch.randn(per_tensor // 4) for i in range(4)}
    state["embedding"] = torch.randn(1 << 18).to(torch.bfloat16)
    state["step_counts"] = torch.arange(100_003, dtype=torch.int64)
    state["empty"] = torch.empty(0, 7)
    state["scale"] = torch.tensor(0.5)
    used = sum(t.numel() * t.element_size() for t in state.values())
    state["rest"] = torch.randn(max(0, nbytes - used) // 4)
    return state


def _save_source(base: str, nbytes: int) -> ObjectRecord:
    """Save one version with the real saver; returns its object's commit record entry."""
    with CheckpointSaver(base) as saver:
        return saver.save(STEP, _state_of(nbytes), keep=None).objects[0]


class Endpoints:
    """The sending base with its object, and the receiving base with its spare directory."""

    def __init__(self, root: str, nbytes: int) -> None:
        self.src = CheckpointLayout(os.path.join(root, "src"))
        self.dst = CheckpointLayout(os.path.join(root, "dst"))
        self.dst.base_dir.mkdir(parents=True)
        self.record = _save_source(os.fspath(self.src.base_dir), nbytes)
        self.object_path = self.src.object_path(STEP, self.record.name)
        self.remote = f"step-{STEP}/{self.record.name}"
        self.replica = self.dst.object_path(STEP, self.record.name)
        self.fetched = self.dst.version_dir(STEP) / "fetched.fpo"

    def retire_into_spares(self, path: Path) -> None:
        """What the replication service does with a retired replica: keep it as a spare."""
        spares = SpareFiles(self.dst, budget=path.stat().st_size)
        spares.retire(path, path.stat().st_size)
        spares.trim()


def _push(ends: Endpoints, port: int, *, known_crc: bool, zero_copy: bool, spare: bool) -> float:
    fd = os.open(ends.object_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        started = time.perf_counter()
        crc = whole_object_crc32c(fd, str(ends.object_path), ends.record) if known_crc else None
        crc_seconds = time.perf_counter() - started
        r = _core.transfer_push_fd(HOST, port, SECRET, fd, ends.remote, length=ends.record.nbytes, crc32c=crc,
                                   zero_copy=zero_copy, retries=0)
    finally:
        os.close(fd)
    assert r["nbytes"] == ends.record.nbytes
    _dispose(ends, ends.replica, spare)
    return r["nbytes"] / (crc_seconds + r["seconds"])


def _fetch(ends: Endpoints, port: int, *, spare: bool) -> float:
    r = _core.transfer_fetch(HOST, port, SECRET, ends.remote, os.fspath(ends.dst.base_dir),
                             os.path.relpath(ends.fetched, ends.dst.base_dir),
                             spare_dir=REPLICA_SPARES if spare else None, retries=0)
    _dispose(ends, ends.fetched, spare)
    return r["nbytes"] / r["seconds"]


def _dispose(ends: Endpoints, path: Path, spare: bool) -> None:
    """Steady runs keep the received file as a spare; cold runs delete it (the next one starts cold)."""
    if spare:
        ends.retire_into_spares(path)
    else:
        path.unlink()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _summary(values: list[float]) -> dict:
    return {"median_gb_per_s": round(statistics.median(values) / 1e9, 3),
            "best_gb_per_s": round(max(values) / 1e9, 3),
            "runs_gb_per_s": [round(v / 1e9, 3) for v in values]}


def _ratio(results: dict[str, list[float]], key: str) -> float:
    return round(statistics.median(results[key]) / statistics.median(results["raw_tcp"]), 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="object size in MiB (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs of each kind (default 5)")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs to put both base directories on")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    kinds = ["raw_tcp", "push", "push_sendfile", "push_cold", "fetch", "fetch_cold"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}

    root = tempfile.mkdtemp(prefix="flashpoint-bench-xfer-", dir=args.dir)
    try:
        ends = Endpoints(root, nbytes)
        dst = os.fspath(ends.dst.base_dir)
        with _core.TransferServer(dst, SECRET, max_connections=2, spare_dir=REPLICA_SPARES) as steady, \
                _core.TransferServer(dst, SECRET, max_connections=2) as cold, \
                _core.TransferServer(os.fspath(ends.src.base_dir), SECRET, max_connections=2) as source:
            runs = {
                "raw_tcp": lambda: raw_tcp_throughput(nbytes)["bytes_per_s"],
                "push": lambda: _push(ends, steady.port, known_crc=True, zero_copy=False, spare=True),
                "push_sendfile": lambda: _push(ends, steady.port, known_crc=True, zero_copy=True, spare=True),
                "push_cold": lambda: _push(ends, cold.port, known_crc=False, zero_copy=False, spare=False),
                "fetch": lambda: _fetch(ends, source.port, spare=True),
                "fetch_cold": lambda: _fetch(ends, source.port, spare=False),
            }
            for kind in kinds:  # warm-up: page cache, socket buffers, code paths, the first spare
                runs[kind]()
            for _ in range(args.repeats):
                for kind in kinds:
                    before = _cpu_seconds()
                    results[kind].append(runs[kind]())
                    cpu[kind].append((_cpu_seconds() - before) / (nbytes / 1e9))
            steady_stats = steady.stats()
            server_errors = steady.errors() + cold.errors() + source.errors()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    out = {
        "object_mib": args.mib,
        "object_nbytes": ends.record.nbytes,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "crc32c_backend": _core.crc32c_backend(),
        "tag": "AES-256-GMAC",
        "tag_library": _core.crypto_library(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        **{k: _summary(v) for k, v in results.items()},
        **{f"cpu_s_per_gb_{k}": round(statistics.median(v), 3) for k, v in cpu.items()},
        "ratio_push_vs_raw": _ratio(results, "push"),
        "ratio_push_sendfile_vs_raw": _ratio(results, "push_sendfile"),
        "ratio_push_cold_vs_raw": _ratio(results, "push_cold"),
        "ratio_fetch_vs_raw": _ratio(results, "fetch"),
        "ratio_fetch_cold_vs_raw": _ratio(results, "fetch_cold"),
        "ratio_best_push_vs_best_raw": round(max(results["push"]) / max(results["raw_tcp"]), 3),
        "steady_pushes_into_spares": steady_stats["spares_taken"],
        "steady_pushes_through_kept_mappings": steady_stats["mappings_reused"],
        "target_ratio": 0.7,
        "server_errors": server_errors,
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
