"""One rank of a job that saves and loads through FlashpointLocalCheckpointManager (tests/test_nvrx.py).

Megatron-core's MCoreTensorAwareStateDict is what goes in and comes out, as NeMo's hierarchical IO
and Megatron-LM hand it over. Phase "save" saves iterations 1..--saves (seed = iteration), through
NVRx's or Megatron's async queue or synchronously (--first: the first iteration); with --kill-rank,
that rank then stages one more save and SIGKILLs itself before its finalize (the others wait in
finalize until the launcher ends them). Phase "resume" finds the newest iteration, loads it and
checks every value bit for bit; "resume-save" does that, then the saves. --content-metadata: the
manager's content_metadata (JSON), as NeMo's optimizer-sharding metadata.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch.distributed as dist  # noqa: E402
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict  # noqa: E402

from ml_flashpoint_nemo.nvrx import FlashpointLocalCheckpointManager, LocalCheckpointingError  # noqa: E402
from tests.support.megatron_scenarios import check_loaded, sharded_state  # noqa: E402


def tensor_aware(seed: int, algo: str) -> MCoreTensorAwareStateDict:
    state, _ = MCoreTensorAwareStateDict.from_state_dict(sharded_state(seed), algo=algo)
    return state


def async_queue(mode: str):
    if mode == "nvrx":
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

        return AsyncCallsQueue(persistent=False)
    if mode == "megatron":
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue(persistent=False)
    return None


def save_phase(manager: FlashpointLocalCheckpointManager, args: argparse.Namespace) -> dict:
    queue = async_queue(args.mode)
    last = args.first + args.saves - 1
    for iteration in range(args.first, last + 1):
        request = manager.save(tensor_aware(iteration, args.algo), iteration, is_async=queue is not None)
        if queue is not None:
            assert type(request).__module__.startswith("nvidia_resiliency_ext"), type(request)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        else:
            assert request is None
    if args.kill_rank is not None:
        manager.save(tensor_aware(last + 1, args.algo), last + 1, is_async=True)  # staged only
        if dist.get_rank() == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # the others wait here until the launcher ends them
    return {"saved": list(range(args.first, last + 1))}


def resume_phase(manager: FlashpointLocalCheckpointManager, args: argparse.Namespace) -> dict:
    latest = manager.find_latest()
    result: dict = {"latest": latest}
    if latest >= 0:
        state, ckpt_id = manager.load()
        # gather_object: the exchange of fully_parallel that runs without CUDA (the others allocate on the GPU)
        loaded = state.to_state_dict(sharded_state(0, zeros=True), algo=args.algo, exchange_algo="gather_object")
        check_loaded(loaded, latest)  # bit for bit: every tensor with torch.equal, the objects with ==
        result.update(ckpt_id=list(ckpt_id), checked=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--phase", choices=["save", "resume", "resume-save"], required=True)
    parser.add_argument("--mode", choices=["sync", "nvrx", "megatron"], default="sync")
    parser.add_argument("--algo", choices=["atomic", "fully_parallel"], default="atomic")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--kill-rank", type=int)
    parser.add_argument("--unusable-root-rank", type=int)
    parser.add_argument("--content-metadata", type=json.loads)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    base = args.base
    if dist.get_rank() == args.unusable_root_rank:  # this rank's root is a file: its node cannot save
        base = str(Path(args.out, "a-file"))
        Path(base).write_text("not a directory")
    content = args.content_metadata
    manager = FlashpointLocalCheckpointManager(
        base, session_id="job", content_metadata=None if content is None else (lambda: content)
    )
    try:
        result = resume_phase(manager, args) if args.phase.startswith("resume") else {}
        if args.phase.endswith("save"):
            result.update(save_phase(manager, args))
    except LocalCheckpointingError as exc:
        result = {"error": str(exc)}
    Path(args.out, f"{args.phase}-rank-{dist.get_rank()}.json").write_text(json.dumps(result))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
