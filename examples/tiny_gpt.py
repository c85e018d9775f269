"""A tiny NeMo 2.0 GPT training job on CPU, 2 ranks over gloo, for quickstarts and tests.

Each rank is a plain process with torchrun-style env vars (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); Lightning's LightningEnvironment sees LOCAL_RANK and does not
spawn processes itself. Everything is fp32 with dropout off, so an uninterrupted run and a
save/SIGKILL/resume run can be compared bit for bit (see TinyMockDataModule for the data
side of that).

Demo, 2 ranks (the script starts them itself when RANK is unset):
    python examples/tiny_gpt.py --steps 6 --out /tmp/tiny
    python examples/tiny_gpt.py --steps 8 --ckpt-every 4 --kill-at-step 6 --out /tmp/tiny_ck
    python examples/tiny_gpt.py --steps 8 --ckpt-every 4 --out /tmp/tiny_ck   # resumes
Each run writes losses_rank{r}.json and (rank 0) final_state.pt under --out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

_T_START = time.time()


if __name__ == "__main__" and "RANK" not in os.environ:
    # Demo entry without a launcher: start the 2 ranks before paying for the NeMo imports here.
    from launch import launch_ranks

    sys.exit(1 if launch_ranks(__file__, sys.argv[1:]) else 0)

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402 - CPU stand-ins for CUDA-only calls

cpu_shims.install()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from nemo import lightning as nl  # noqa: E402
from nemo.collections import llm  # noqa: E402
from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer  # noqa: E402
from nemo.collections.llm.gpt.data.mock import MockDataModule, _MockGPTDataset  # noqa: E402

if TYPE_CHECKING:
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint

SEQ_LEN = 32
VOCAB = 255  # NullTokenizer adds one EOD id: vocab_size 256


class TinyMockDataModule(MockDataModule):
    """MockDataModule with two fixes needed for training and for an exact resume.

    1. `setup` passes the dataset arguments by keyword. NeMo 2.7.3's MockDataModule.setup
       calls _MockGPTDataset(tokenizer, name, num_samples, seq_length, create_attention_mask),
       but the 5th positional parameter is `seed`: the flag becomes the seed and no attention
       mask is built. Without Transformer Engine (always so on CPU) gpt_forward_step then
       asserts on the missing attention_mask.
    2. It saves and restores `consumed_samples` like PreTrainingDataModule does
       (state_dict/load_state_dict, init_global_step). MockDataModule has neither, so after a
       resume its MegatronDataSampler starts again at sample 0 and the resumed run trains on
       different data than an uninterrupted one.
    """

    def __init__(self, *args: Any, data_seed: int = 42, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_seed = data_seed
        self.init_global_step = 0

    def setup(self, stage: str = "") -> None:
        def ds(name: str, n: int) -> _MockGPTDataset:
            return _MockGPTDataset(
                self.tokenizer,
                name,
                n,
                self.seq_length,
                seed=self.data_seed,
                create_attention_mask=self.create_attention_mask,
            )

        self._train_ds = ds("train", self.num_train_samples)
        self._validation_ds = ds("valid", self.num_val_samples)
        self._test_ds = ds("test", self.num_test_samples)

    def _create_dataloader(self, dataset: Any, **kwargs: Any) -> Any:
        # As PreTrainingDataModule: consumed samples are counted from the step we (re)started at.
        self.init_global_step = self.trainer.global_step
        self.data_sampler.init_global_step = self.init_global_step
        return super()._create_dataloader(dataset, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """Saved into the checkpoint by Lightning (under the class's qualified name)."""
        steps = self.trainer.global_step - self.init_global_step
        return {"consumed_samples": self.data_sampler.compute_consumed_samples(steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the sampler position before the train dataloader is built (as PreTrainingDataModule)."""
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        consumed = state_dict["consumed_samples"]
        self.data_sampler.init_consumed_samples = consumed
        self.data_sampler.prev_consumed_samples = consumed
        update_num_microbatches(consumed_samples=consumed, consistency_check=False)
        self.data_sampler.if_first_step = 1


def make_tokenizer() -> NullTokenizer:
    """A file-free tokenizer (the default GPT2 BPE one needs downloaded vocab files).

    Built through io.track_io so ModelCheckpoint can serialize it into the checkpoint's
    context/ directory (otherwise it warns "Unserializable value ... NullTokenizer").
    """
    if not getattr(NullTokenizer, "_tiny_gpt_io_tracked", False):  # track_io may run only once per class
        nl.io.track_io(NullTokenizer)
        NullTokenizer._tiny_gpt_io_tracked = True
    return NullTokenizer(VOCAB)


def make_model(seq_len: int = SEQ_LEN, lr: float = 1e-3, dropout: float = 0.0) -> llm.GPTModel:
    """2 layers, hidden 64, 4 heads, fp32, no CUDA-only fused kernels.

    Dropout is off by default: neither NeMo nor Lightning checkpoints the RNG state, so with
    dropout > 0 a resumed run draws different masks than an uninterrupted one.
    """
    config = llm.GPTConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        seq_length=seq_len,
        vocab_size=VOCAB + 1,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    return llm.GPTModel(config, optim=make_optim(lr), tokenizer=make_tokenizer())


def make_data(
    seq_len: int = SEQ_LEN, micro_batch_size: int = 1, global_batch_size: int = 4, seed: int = 42
) -> TinyMockDataModule:
    """Deterministic mock tokens: sample i is drawn from numpy's default_rng(seed + i)."""
    return TinyMockDataModule(
        seq_length=seq_len,
        tokenizer=make_tokenizer(),
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        num_train_samples=100_000,
        num_val_samples=16,
        num_test_samples=16,
        num_workers=0,
        pin_memory=False,
        create_attention_mask=True,
        data_seed=seed,
    )


def make_optim(lr: float = 1e-3) -> nl.MegatronOptimizerModule:
    """Adam in fp32 with the plain (not distributed) Megatron optimizer: simplest on gloo.

    clip_grad=0.0: Megatron's clip_grad_by_total_norm_fp32 asserts that every grad is a
    torch.cuda.FloatTensor (optimizer/clip_grads.py:167).
    """
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.01,
        clip_grad=0.0,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=False,
    )
    return nl.MegatronOptimizerModule(config=config)


def make_trainer(
    max_steps: int,
    *,
    ckpt_async_save: bool = False,
    callbacks: Optional[Sequence[pl.Callback]] = None,
    plugins: Optional[Sequence[Any]] = None,
    devices: Optional[int] = None,
    **trainer_kwargs: Any,
) -> nl.Trainer:
    """A CPU/gloo nl.Trainer with MegatronStrategy (TP=PP=1, data parallel over all ranks)."""
    strategy = nl.MegatronStrategy(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_async_save=ckpt_async_save,
        process_group_backend="gloo",
    )
    # No progress bar: NeMo swaps Lightning's bar for its ProgressPrinter, which on rank 0 only
    # all-gathers Megatron timers over the world group; gloo (unlike NCCL) does not skip that
    # 0-element collective, so rank 0 desyncs and the next world collective (checkpointing) hangs.
    trainer_kwargs.setdefault("enable_progress_bar", False)
    trainer_kwargs.setdefault("logger", False)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    return nl.Trainer(
        accelerator="cpu",
        devices=devices or int(os.environ.get("WORLD_SIZE", "1")),
        num_nodes=1,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=list(callbacks or []),
        plugins=list(plugins or []),
        **trainer_kwargs,
    )


class LossRecorder(pl.Callback):
    """Records (global_step, loss) after every optimizer step.

    global_step is read after the step, so the first step is 1. The loss is the one Megatron
    averaged over the data-parallel ranks, hence the same on every rank.
    """

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self.step_end_times: list[float] = []  # time.perf_counter() after each step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs if torch.is_tensor(outputs) else outputs["loss"]
        self.losses.append((int(trainer.global_step), float(loss.detach().float().item())))
        self.step_end_times.append(time.perf_counter())

    def dump(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.losses))


def model_state_dict(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The Megatron module's parameters and buffers (CPU clones), for bit-exact comparisons."""
    module = trainer.strategy.megatron_parallel  # list of model chunks; one without PP
    return {k: v.detach().clone() for k, v in module[0].state_dict().items() if torch.is_tensor(v)}


def make_checkpointing(
    log_dir: str | os.PathLike[str], every_n_train_steps: int
) -> tuple[nl.NeMoLogger, "ModelCheckpoint"]:
    """NeMoLogger + NeMo ModelCheckpoint saving torch_dist checkpoints every N steps.

    monitor="reduced_train_loss" because there is no validation; save_top_k=-1 keeps every
    checkpoint; save_optim_on_train_end=True so the checkpoint written at max_steps keeps
    the optimizer too (NeMo's default makes it weights-only, and AutoResume from it with more
    steps then fails on missing optimizer.state.* keys); use_datetime_version=False because
    NeMoLogger only computes the datetime version on rank 0, which would give the ranks
    different log dirs. Checkpoints land in <log_dir>/tiny/checkpoints/<name>/weights, and
    AutoResume only picks the "*-last" ones. In the name, {step} is the "step" metric that
    MegatronStrategy logs before the optimizer step, i.e. global_step - 1 (tiny--step=3-...
    holds the state after 4 steps); consumed_samples is exact.
    """
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(
        monitor="reduced_train_loss",
        save_top_k=-1,
        save_last=True,
        every_n_train_steps=every_n_train_steps,
        save_optim_on_train_end=True,
        filename="tiny--{step}-{consumed_samples}",
    )
    logger = nl.NeMoLogger(name="tiny", log_dir=str(log_dir), use_datetime_version=False, ckpt=ckpt)
    return logger, ckpt


def make_resume() -> nl.AutoResume:
    """Resume from the newest checkpoint under the NeMoLogger dir, if any (else start fresh)."""
    return nl.AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True)


class KillAtStep(pl.Callback):
    """SIGKILLs every rank right after optimizer step `step` (a crash, no cleanup)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            import signal

            io = trainer.strategy.checkpoint_io
            if hasattr(io, "maybe_finalize_save_checkpoint"):
                io.maybe_finalize_save_checkpoint(blocking=True)  # let a pending async save land first
            os.kill(os.getpid(), signal.SIGKILL)


def _median_gap(times: Sequence[float]) -> float:
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Demo / test driver: plain run, or save every --ckpt-every steps, optionally kill and resume."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="/tmp/tiny_gpt_out")
    ap.add_argument("--ckpt-every", type=int, default=0, help="0: no checkpointing")
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--dropout", type=float, default=0.0)
    args = ap.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    rec = LossRecorder()
    callbacks: list[pl.Callback] = [rec]
    if args.kill_at_step:
        callbacks.append(KillAtStep(args.kill_at_step))
    log, resume = nl.NeMoLogger(name="tiny", log_dir=str(out / "logs"), use_datetime_version=False), None
    if args.ckpt_every:
        log, ckpt = make_checkpointing(out / "logs", args.ckpt_every)
        callbacks.append(ckpt)
        resume = make_resume()
    trainer = make_trainer(
        args.steps, ckpt_async_save=args.async_save, callbacks=callbacks, enable_checkpointing=bool(args.ckpt_every)
    )
    model, data = make_model(dropout=args.dropout), make_data()
    t1 = time.time()
    # llm.train, not trainer.fit: its _setup also runs NeMoLogger.setup, AutoResume.setup and
    # CallbackGroup.update_config (the telemetry config that ModelCheckpoint's hooks require).
    llm.train(model, data, trainer, log=log, resume=resume)
    t2 = time.time()
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    rec.dump(out / f"losses_rank{rank}.json")
    if rank == 0:
        torch.save(model_state_dict(trainer), out / "final_state.pt")
        print(f"losses {rec.losses}", flush=True)
    print(
        f"rank {rank}: imports {t0 - _T_START:.1f}s, build {t1 - t0:.1f}s, "
        f"train {t2 - t1:.1f}s for {len(rec.losses)} steps "
        f"({_median_gap(rec.step_end_times):.3f}s/step)",
        flush=True,
    )


if __name__ == "__main__":
    main()
