"""What the first save of a process costs beyond a later one, and the planning that makes the difference.

bench_core.py's save_first row times one save in a fresh process against the copy limit. This
script splits it: in --runs fresh processes (each pre-faults its pool first, as save_first does)
it times the first CheckpointSaver.save and the saves after it, and in this process it times the
pieces of the plan a first save builds for the same state (best of --repeats each):

- tensor_columns  the state's tensors as columns (every save does this);
- plan_object     record offsets and the index template (first save only);
- IndexTemplate   the index template alone (part of plan_object);
- padding_ops     the copy ops that zero the layout's gaps (first save only).

    python benchmarks/bench_first_save.py --size-gib 1
    python benchmarks/bench_first_save.py --size-gib 1 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_core import GIB, build_state, plan_state, state_nbytes  # noqa: E402

CHILD_FLAG = "--child"


def child(size_gib: float, saves: int, base_dir: str) -> None:
    """In a fresh process: pre-fault the pool, then time `saves` saves of one state (the first one first)."""
    from ml_flashpoint_nemo.core import CheckpointSaver

    specs = plan_state(int(size_gib * GIB))
    base = tempfile.mkdtemp(dir=base_dir)
    try:
        with CheckpointSaver(base) as saver:
            warmup = saver.warm_up(state_nbytes(specs))
            state = build_state(specs)
            warmup.result()
            seconds = []
            for step in range(saves):
                started = time.perf_counter()
                saver.save(step, state)
                seconds.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"seconds": seconds}))


def best_of(repeats: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def planning(size_gib: float, repeats: int) -> dict[str, Any]:
    from ml_flashpoint_nemo.core.format import IndexTemplate, plan_object
    from ml_flashpoint_nemo.core.saver import padding_copy_ops
    from ml_flashpoint_nemo.core.values import tensor_columns

    state = build_state(plan_state(int(size_gib * GIB)))
    columns = tensor_columns(state)
    assert columns is not None, "the benchmark's state is plain CPU tensors"
    signature = columns.signature()
    plan = plan_object(signature)
    return {
        "records": len(plan.entries),
        "tensor_columns_ms": best_of(repeats, lambda: tensor_columns(state)) * 1e3,
        "plan_object_ms": best_of(repeats, lambda: plan_object(signature)) * 1e3,
        "index_template_ms": best_of(repeats, lambda: IndexTemplate(plan.entries)) * 1e3,
        "padding_ops_ms": best_of(repeats, lambda: padding_copy_ops(plan)) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes")
    parser.add_argument("--saves", type=int, default=4, help="saves per process, the first included")
    parser.add_argument("--repeats", type=int, default=15, help="timings of each planning piece (best is kept)")
    parser.add_argument("--base-dir", default="/dev/shm")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.size_gib, args.saves, args.base_dir)
        return 0
    if args.saves < 2:
        parser.error("--saves must be at least 2: the first save is compared with the later ones")
    runs = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, __file__, CHILD_FLAG, "--size-gib", str(args.size_gib),
                               "--saves", str(args.saves), "--base-dir", args.base_dir],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
        runs.append({"first_ms": seconds[0] * 1e3, "later_median_ms": statistics.median(seconds[1:]) * 1e3})
    result = {"size_gib": args.size_gib, "runs": runs, **planning(args.size_gib, args.repeats)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['records']} records, {args.size_gib} GiB")
    for run in runs:
        print(f"  first save {run['first_ms']:.1f} ms, later saves (median) {run['later_median_ms']:.1f} ms, "
              f"extra {run['first_ms'] - run['later_median_ms']:.1f} ms")
    print(f"  planning, best of {args.repeats}: tensor_columns {result['tensor_columns_ms']:.2f} ms, plan_object "
          f"{result['plan_object_ms']:.2f} ms (IndexTemplate {result['index_template_ms']:.2f} ms), padding ops "
          f"{result['padding_ops_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
