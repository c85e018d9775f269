"""CPU cost of each CRC32C implementation this CPU can run, as a ratio to a memcpy of the same bytes,
and of the transfer protocol's AES-256-GMAC tag (OpenSSL's libcrypto; the `gmac` line).

The data (512 KiB by default) stays in the L2 cache, and every figure is the thread's CPU time
(time.thread_time), not wall-clock time: what is measured is the work per byte, which does not
change when other processes share the cores (wall-clock figures do). A checksum whose cost is
well below a copy's can ride along with the copy in one memory pass. A GMAC call tags one
message of 16 copies of the data, so its context and key set-up is spread over 16 times the
bytes of a line, like a transfer session's over its chunks.

    python benchmarks/bench_crc32c.py            # table
    python benchmarks/bench_crc32c.py --json     # one JSON object per line
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from typing import Callable

from ml_flashpoint_nemo import _core

KIB = 1 << 10


def cpu_seconds_per_call(action: Callable[[], object], calls: int, rounds: int) -> list[float]:
    """Per round, the thread CPU time of `calls` calls divided by calls."""
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            action()
        samples.append((time.thread_time() - start) / calls)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", type=int, default=512, help="bytes per call, in KiB (default %(default)s: in L2)")
    parser.add_argument("--calls", type=int, default=400, help="calls per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if args.kib < 1 or args.calls < 1 or args.rounds < 1:
        parser.error("--kib, --calls and --rounds must be positive")

    nbytes = args.kib * KIB
    source = (ctypes.c_uint8 * nbytes).from_buffer_copy(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    target = (ctypes.c_uint8 * nbytes)()
    actions: dict[str, Callable[[], object]] = {"memcpy": lambda: ctypes.memmove(target, source, nbytes)}
    for backend in _core.crc32c_backends():
        actions[f"crc32c {backend}"] = lambda backend=backend: _core.crc32c_using(backend, source)
    copies = 16  # of the data per GMAC message
    gmac_parts = [source] * copies
    actions["gmac"] = lambda: _core.gmac(bytes(32), bytes(12), gmac_parts)
    # Per line: calls per round and the bytes they process, divided out so every line is per nbytes.
    scale = {name: copies if name == "gmac" else 1 for name in actions}

    # Interleaved rounds, so that a slow spell lands on every line alike.
    samples: dict[str, list[float]] = {name: [] for name in actions}
    for _ in range(args.rounds):
        for name, action in actions.items():
            calls = max(1, args.calls // scale[name])
            samples[name] += [t / scale[name] for t in cpu_seconds_per_call(action, calls, 1)]
    memcpy_seconds = statistics.median(samples["memcpy"])
    for name, values in samples.items():
        median = statistics.median(values)
        row = {
            "name": name,
            "cpu_gbps": round(nbytes / median / 1e9, 2),
            "cost_vs_memcpy": round(median / memcpy_seconds, 3),
            "best_cpu_gbps": round(nbytes / min(values) / 1e9, 2),
            "worst_cpu_gbps": round(nbytes / max(values) / 1e9, 2),
            "nbytes": nbytes,
            "rounds": args.rounds,
        }
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{name:<24} {row['cpu_gbps']:>8.1f} GB/s of CPU time  {row['cost_vs_memcpy']:>6.2f}x a memcpy's cost"
                  f"  (best {row['best_cpu_gbps']}, worst {row['worst_cpu_gbps']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
