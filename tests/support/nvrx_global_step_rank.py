"""One rank of a NeMo restart whose global checkpoint one rank sees otherwise (tests/test_nvrx_nemo.py).

Forked from a NeMo-imported server; no training. Every rank wires a NeMo trainer with
use_flashpoint_local_checkpoints, saves local iteration 4 through the manager, and takes part in
real global checkpoints of steps 3 and 5 (Megatron's common state). Every rank loads step 3's but
rank --odd-rank, which sees a copy whose common state is cut short (--odd-view damaged: its node's
copy, say) or step 5's (other-step). Every rank then asks the hierarchical IO to load: it reads the
global step and, on every rank whose local iteration is the newer, enters the manager's collective
load. Each rank writes what its load did to <out>/load-rank-<r>.json and exits without any further
collective.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()  # Megatron's save of the global checkpoint asks for a CUDA device

import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402

from ml_flashpoint_nemo.nvrx import use_flashpoint_local_checkpoints  # noqa: E402
from tests.support.nvrx_nemo_checks import trainer  # noqa: E402
from tests.support.nvrx_peer_states import PlainTensorState  # noqa: E402

LOCAL_ITERATION, GLOBAL_STEP = 4, 3


def global_checkpoint(path: Path, step: int) -> Path:
    """Collective: a real global checkpoint of `step` at `path` (Megatron's common state in its weights/)."""
    if dist.get_rank() == 0:
        (path / "weights").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"global_step": step}, str(path / "weights"))
    dist.barrier()
    return path


def path_seen(out: Path, odd_rank: int, odd_view: str) -> Path:
    """Collective: this rank's path to the global checkpoint; rank odd_rank sees a damaged one or another step."""
    path = global_checkpoint(out / "global", GLOBAL_STEP)
    other = global_checkpoint(out / "global-other-step", GLOBAL_STEP + 2)
    if dist.get_rank() != odd_rank:
        return path
    if odd_view == "other-step":
        return other
    damaged = out / f"global-seen-by-rank-{odd_rank}"
    shutil.copytree(path, damaged)
    common = damaged / "weights" / "common.pt"
    common.write_bytes(common.read_bytes()[:20])
    return damaged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--odd-rank", type=int, required=True)
    parser.add_argument("--odd-view", choices=["damaged", "other-step"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    io = use_flashpoint_local_checkpoints(trainer(), args.base, every_n_train_steps=2, session_id="job")
    io.local_ckpt_manager.save(PlainTensorState(LOCAL_ITERATION * 1000 + rank), LOCAL_ITERATION)
    path = path_seen(Path(args.out), args.odd_rank, args.odd_view)
    try:
        io.load_checkpoint(path)
        result = {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(args.out, f"load-rank-{rank}.json").write_text(json.dumps(result))
    io.local_ckpt_manager.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is written: skip the NeMo-loaded interpreter's finalization (~4 s per rank here)


if __name__ == "__main__":
    main()
