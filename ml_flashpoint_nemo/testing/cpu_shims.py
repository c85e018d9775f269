"""Every CUDA shim needed to train with Megatron-core 0.15.3 and NeMo 2.7.3 on a CPU-only torch.

Call `install()` once, before building the model/trainer (and in every rank process). It does
nothing when CUDA is available, and nothing the second time (a flag on `torch.cuda`, so
importing this module under two names is also safe). Each shim only acts where the unshimmed
call would raise on a CPU-only torch, so it cannot change the result of code that works
without it. The shims, and the calls that need them:

1. `torch.cuda.synchronize` -> no-op. Megatron's dist-checkpointing synchronizes around
   every save and load (dist_checkpointing/strategies/filesystem_async.py:230, also used by
   sync torch_dist saves; strategies/fully_parallel.py:272 on load).
2. `torch.cuda.current_device` -> "cpu". Megatron and NeMo create tensors with
   device=torch.cuda.current_device(): parameters (tensor_parallel/layers.py:255), loss
   reductions (nemo/lightning/megatron_parallel.py:348, :1847), NeMo
   ModelCheckpoint._monitor_candidates.
3. `torch.cuda.Stream` -> None and `torch.cuda.stream` -> nullcontext. NeMo's
   MegatronParallel.init_model_parallel runs init_ddp inside
   `torch.cuda.stream(torch.cuda.Stream())` (megatron_parallel.py:617).
4. `CudaRNGStatesTracker.fork` of a state that was never added -> nullcontext. NeMo only
   calls model_parallel_cuda_manual_seed when torch.cuda.device_count() > 0
   (nemo/lightning/megatron_init.py:238), so on CPU the tracker stays empty and fork() raises
   "cuda rng state model-parallel-rng is not added": at weight init
   (tensor_parallel/layers.py:136) and in every attention forward
   (transformer/dot_product_attention.py:207). With the shim those ops draw from the CPU
   default generator, which NeMo seeds identically on every rank. Forks of added states run
   unchanged. (So TP>1 on CPU would not get per-TP-rank dropout streams; use TP=1.)
5. A TorchFunctionMode (`_CudaDeviceToCpu`) that rewrites requests for CUDA memory into CPU
   ones: device="cuda..." -> "cpu", `.to("cuda")` -> `.to("cpu")`, `.cuda()` and
   `.pin_memory()` -> the tensor itself, pin_memory=True -> False. Needed for hard-coded
   CUDA in: gpt_data_step `val.cuda(non_blocking=True)` (llm/gpt/model/base.py:103),
   MegatronStrategy.training_step and MegatronDataSampler logging
   `torch.tensor(x, pin_memory=True).to("cuda", non_blocking=True)`
   (megatron_strategy.py:801, :850; data_sampler.py:192, :212), Megatron's optimizer
   `torch.tensor([1.0], device='cuda')` (optimizer/optimizer.py:903), the pipeline schedule
   `torch.zeros(..., device='cuda')` (pipeline_parallel/schedules.py:573) and the fully
   parallel checkpoint load's exchange buffers (dist_checkpointing/exchange_utils.py:113,
   :502). It is entered on the thread that calls install() (torch function modes are per
   thread); forked children (Megatron's async-save worker) inherit it.
6. `nemo.lightning.io.pl._fix_tensors_device` -> identity, applied when NeMo imports that
   module. MegatronCheckpointIO.load_checkpoint calls it after every load and it asserts
   torch.cuda.is_initialized() (io/pl.py:495); it only moves CUDA tensors between CUDA
   devices, and a CPU-only torch has none. (Shimming torch.cuda.is_initialized instead would
   make torch's own lazy CUDA calls, e.g. torch.cuda.manual_seed_all, run eagerly and fail.)

Deliberately not shimmed (configure instead; see examples/tiny_gpt.py): gradient clipping
(Megatron's clip_grad_norm asserts CUDA tensors; use OptimizerConfig(clip_grad=0.0)), the
CUDA-only fused kernels (turn off the *_fusion flags), NeMo's ProgressPrinter (hangs gloo;
use enable_progress_bar=False) and the telemetry config (train through llm.train).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Collection

import torch
from torch.overrides import TorchFunctionMode

_FLAG = "_ml_flashpoint_cpu_shims_installed"


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaDeviceToCpu(TorchFunctionMode):
    """Turns requests for CUDA (or pinned) memory into CPU ones; everything else passes through."""

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` is first imported (so install() needs no NeMo import)."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # a hook after the stdlib's loader
        return spec


def _patch_nemo_io_pl(module: Any) -> None:
    module._fix_tensors_device = lambda ckpt: ckpt


def _cpu_device() -> str:
    return "cpu"


def _no_stream(*args: Any, **kwargs: Any) -> None:
    return None


def _no_stream_context(stream: Any = None) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


def install_for_checkpointing() -> None:
    """Shims 1 and 2 only: enough for megatron.core.dist_checkpointing (tests, benchmarks).

    Without the function mode of install(), so timings of torch calls are not distorted.
    """
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]  # a device name where torch says int


def install() -> None:
    """Installs the shims listed in the module docstring; no-op with CUDA or when already installed."""
    if torch.cuda.is_available() or getattr(torch.cuda, _FLAG, False):
        return
    setattr(torch.cuda, _FLAG, True)

    install_for_checkpointing()
    torch.cuda.Stream = _no_stream  # type: ignore[misc,assignment]  # the class replaced by a function
    torch.cuda.stream = _no_stream_context  # type: ignore[assignment]  # a null context, not a StreamContext

    from megatron.core.tensor_parallel import random as mrandom

    original_fork = mrandom.CudaRNGStatesTracker.fork

    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Any:
        if name not in self.states_:
            return contextlib.nullcontext()
        return original_fork(self, name)

    mrandom.CudaRNGStatesTracker.fork = fork

    nemo_io = "nemo.lightning.io.pl"
    if nemo_io in sys.modules:
        _patch_nemo_io_pl(sys.modules[nemo_io])
    else:
        sys.meta_path.insert(0, _PatchAfterImport(nemo_io, _patch_nemo_io_pl))

    mode = _CudaDeviceToCpu()
    mode.__enter__()  # stays entered for the life of the process (this thread)
    setattr(torch.cuda, "_ml_flashpoint_cpu_mode", mode)  # noqa: B010 - not an attribute torch.cuda declares
