"""One call that puts FlashpointLocalCheckpointManager behind NeMo's LocalCheckpointCallback (docs/nvrx.md).

NeMo 2's own wiring (``nemo.lightning.pytorch.local_ckpt.update_trainer_local_checkpoint_io``)
builds NVRx's ``LocalCheckpointManager`` itself; ``use_flashpoint_local_checkpoints`` builds the
same ``MCoreHierarchicalCheckpointIO`` around the strategy's checkpoint IO with our manager.

Resuming with no global checkpoint: Lightning's ``_CheckpointConnector.resume_start`` returns
before reading anything when the trainer has no checkpoint path, so the hierarchical IO's
``load_checkpoint`` (the only place that asks the local manager) never runs. This module makes
``resume_start`` ask the manager first (a collective, on every rank) and, when a local version
exists, hand the trainer that version's directory as its path. NeMo's strategy reads the
content metadata of the path it loads from the global checkpoint; for a local version it gets
the strategy's own metadata, which is what the save used.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from nemo.lightning.pytorch.local_ckpt import MCoreHierarchicalCheckpointIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO
from nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback import LocalCheckpointCallback

from ml_flashpoint_nemo.core.topology import problems_of_every_rank, reduced_ints
from ml_flashpoint_nemo.nvrx.conversion import TensorAwareConversion
from ml_flashpoint_nemo.nvrx.manager import FlashpointLocalCheckpointManager, LocalCheckpointingError
from ml_flashpoint_nemo.replication.service import ReplicationConfig

logger = logging.getLogger(__name__)

_HOOK_MARK = "_flashpoint_local_resume"  # a function attribute on our resume_start


def global_step_of(path: Any) -> int:
    """The global step saved in a NeMo (global) checkpoint's common state; -1 when there is none to read."""
    if not path:
        return -1
    from megatron.core import dist_checkpointing
    from nemo.lightning.io.pl import ckpt_to_weights_subdir

    return int(
        dist_checkpointing.load_common_state_dict(str(ckpt_to_weights_subdir(path, is_saving=False)))["global_step"]
    )


def _on_cpu(value: Any) -> Any:
    """A common-state value as the local save stores it: a GPU tensor copied to the CPU, as NeMo's IO does, but
    waited for (NeMo's non_blocking copy lands in pinned memory later than the pickling of the staging may read it;
    the common state is a few small values, so waiting costs nothing measurable)."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to("cpu")
    return value


class FlashpointHierarchicalCheckpointIO(MCoreHierarchicalCheckpointIO):
    """NeMo's hierarchical IO whose local checkpoints are our manager's RAM versions.

    ``loaded_local_iteration``: the local iteration the last load read, None when it read the
    global checkpoint (or nothing yet). ``conversion``: the state dict's conversion before each
    save, which runs Megatron's sharding check on the first save and after the sharding changed,
    not on every save as NeMo's does (nvrx.conversion).
    """

    local_ckpt_manager: FlashpointLocalCheckpointManager

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaded_local_iteration: int | None = None
        self.conversion = TensorAwareConversion(self.local_ckpt_algo, self.parallelization_group)

    def to_tensor_aware_state_dict(self, checkpoint: dict[str, Any]) -> Any:
        """Collective: NeMo's conversion (its common state moved off the GPU), checked only when the sharding changed."""
        state_dict = self.conversion(checkpoint)
        dict_list_map_inplace(_on_cpu, state_dict.common)
        return state_dict

    def is_local_version(self, path: Any) -> bool:
        """Whether `path` is a version directory of our manager (what a resume without global checkpoint loads)."""
        if not path:
            return False
        return Path(path).absolute().parent == self.local_ckpt_manager.base_dir

    def load_checkpoint(self, path: Any, map_location: Any = None, **kwargs: Any) -> dict[str, Any]:
        self.loaded_local_iteration = None
        return super().load_checkpoint(path, map_location=map_location, **kwargs)

    def from_tensor_aware_state_dict(
        self, tensor_aware_checkpoint: Any, sharded_state_dict: Any = None, strict: Any = None
    ) -> Any:
        self.loaded_local_iteration = self.local_ckpt_manager.latest_iteration
        return super().from_tensor_aware_state_dict(tensor_aware_checkpoint, sharded_state_dict, strict)


def use_flashpoint_local_checkpoints(
    trainer: Any,
    root_local_ckpt_dir: str | os.PathLike[str],
    *,
    every_n_train_steps: int | None = None,
    session_id: str = "",
    keep: int = 1,
    replication: ReplicationConfig | None = None,
    get_global_ckpt_iteration_fn: Callable[[Any], int] | None = None,
    resume_without_global: bool = False,
    **io_kwargs: Any,
) -> FlashpointHierarchicalCheckpointIO:
    """Save NeMo local checkpoints into RAM versions and resume from the newer of local and global.

    Call once after building the trainer, before ``llm.train`` / ``trainer.fit``. Adds a
    ``LocalCheckpointCallback(every_n_train_steps)`` unless the trainer has one; wraps the
    strategy's checkpoint IO (its inner IO with ``ckpt_async_save``, as NeMo does) in a
    hierarchical IO with our manager (``root_local_ckpt_dir``/``session_id``, ``keep``,
    ``replication``). A restart loads the newer of NeMo's global checkpoint and the newest local
    version. With ``resume_without_global`` a fit that NeMo gives no checkpoint path (no global
    checkpoint yet) also resumes from the newest local version of ``session_id``, which must then
    name this run: a fresh run in a reused root would otherwise continue another run's state.
    ``get_global_ckpt_iteration_fn`` (default: the global step in the checkpoint's common state)
    and ``io_kwargs`` (e.g. ``local_ckpt_algo``) go to ``MCoreHierarchicalCheckpointIO``.
    """
    strategy = trainer.strategy
    checkpoint_io = strategy.checkpoint_io
    wrapped = checkpoint_io.checkpoint_io if isinstance(checkpoint_io, AsyncFinalizableCheckpointIO) else checkpoint_io
    if isinstance(wrapped, FlashpointHierarchicalCheckpointIO):
        raise LocalCheckpointingError("the trainer already uses flashpoint local checkpoints: call this once")
    callbacks = trainer.callbacks
    add_callback = not any(isinstance(cb, LocalCheckpointCallback) for cb in callbacks)
    if add_callback and (not isinstance(every_n_train_steps, int) or every_n_train_steps < 1):
        raise LocalCheckpointingError(
            "the trainer has no LocalCheckpointCallback: pass every_n_train_steps >= 1 "
            f"(got {every_n_train_steps!r}) or add a LocalCheckpointCallback to its callbacks"
        )
    if resume_without_global and not session_id:
        raise LocalCheckpointingError(
            "resume_without_global=True needs a session_id that names this run (e.g. its experiment name): "
            "without one, a fresh run in a reused root would resume another run's RAM versions"
        )
    async_save = bool(getattr(strategy, "async_save", False))
    if async_save:
        if not isinstance(checkpoint_io, AsyncFinalizableCheckpointIO):
            raise LocalCheckpointingError(
                f"the strategy saves asynchronously but its checkpoint IO is a {type(checkpoint_io).__name__}, "
                "not NeMo's AsyncFinalizableCheckpointIO: call this before anything else wraps it"
            )
        checkpoint_io = checkpoint_io.checkpoint_io
    manager = FlashpointLocalCheckpointManager(
        root_local_ckpt_dir,
        session_id,
        keep=keep,
        replication=replication,
        content_metadata=lambda: strategy.sharded_state_dict_metadata,  # what NeMo gives its global saves
    )
    hierarchical = FlashpointHierarchicalCheckpointIO(
        checkpoint_io,
        manager,
        _global_iteration_fn(get_global_ckpt_iteration_fn or global_step_of, manager),
        async_save=async_save,
        **io_kwargs,
    )
    if add_callback:  # only now: a bad argument above leaves the trainer as it was
        callbacks.append(LocalCheckpointCallback(every_n_train_steps=every_n_train_steps))
    strategy.checkpoint_io = AsyncFinalizableCheckpointIO(hierarchical) if async_save else hierarchical
    _answer_content_metadata_of_local_versions(strategy, hierarchical)
    if resume_without_global:
        _resume_from_local_without_global(trainer, hierarchical)
    return hierarchical


def _global_iteration_fn(read: Callable[[Any], int], manager: FlashpointLocalCheckpointManager) -> Callable[[Any], int]:
    """Collective: the global iteration of `path`, the same on every rank; -1 for a local version directory.

    NVRx's hierarchical IO calls it on every rank after find_latest and then enters the collective
    load of whichever checkpoint is newer: a read that fails or answers otherwise on one rank would
    send that rank elsewhere while the others wait in the load. One all-reduce of 24 B first tells
    every rank whether any read failed and the lowest and highest step read.
    """

    def global_iteration(path: Any) -> int:
        step, problem = -1, None
        try:
            if not (path and Path(path).absolute().parent == manager.base_dir):
                step = int(read(path))
        except Exception as exc:  # noqa: BLE001 - every rank must learn it before the load's collectives
            problem = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
        return _agreed_global_iteration(path, step, problem, manager.latest_iteration)

    return global_iteration


def _agreed_global_iteration(path: Any, step: int, problem: str | None, local_iteration: int) -> int:
    """Collective: `step` when every rank read the same one; else LocalCheckpointingError on every rank."""
    any_failed, highest, negated_lowest = reduced_ints([int(problem is not None), step, -step])
    what = (
        f"the restart cannot choose between local checkpoint iteration {local_iteration} and the global "
        f"checkpoint {str(path)!r}"
    )
    if any_failed:
        failed = problems_of_every_rank(problem)
        raise LocalCheckpointingError(
            f"{what}: its global step cannot be read on every rank ({'; '.join(failed)}). Repair or remove that "
            "global checkpoint on the ranks named, or pass get_global_ckpt_iteration_fn, then restart"
        )
    if highest != -negated_lowest:
        raise LocalCheckpointingError(
            f"{what}: the ranks read different global steps from it ({-negated_lowest} to {highest}). Make every "
            "rank see the same global checkpoint, then restart"
        )
    return highest


def _answer_content_metadata_of_local_versions(strategy: Any, io: FlashpointHierarchicalCheckpointIO) -> None:
    """NeMo's strategy reads the content metadata from the checkpoint path before it loads; a local version
    directory holds none, so it is answered with the strategy's own (the manager's find_latest offered that
    version only if its save recorded the same)."""
    inner = strategy.unwrapped_checkpoint_io
    read = inner.load_content_metadata

    def load_content_metadata(path: Any = None, preloaded_state_dict: Any = None) -> Any:
        if io.is_local_version(path):
            return strategy.sharded_state_dict_metadata
        return read(path, preloaded_state_dict=preloaded_state_dict)

    inner.load_content_metadata = load_content_metadata


def _resume_from_local_without_global(trainer: Any, io: FlashpointHierarchicalCheckpointIO) -> None:
    """Make the restore of a fit with no checkpoint path load the newest local version, if there is one."""
    connector = trainer._checkpoint_connector
    if getattr(connector.resume_start, _HOOK_MARK, False):
        return
    original: Callable[..., None] = connector.resume_start

    def resume_start(checkpoint_path: Any = None) -> None:
        if not checkpoint_path and trainer.state.fn == TrainerFn.FITTING:
            manager = io.local_ckpt_manager
            iteration = manager.find_latest()  # collective: every rank restores
            if iteration >= 0:
                checkpoint_path = str(manager.layout.version_dir(iteration))
                logger.info(
                    "No global checkpoint to resume from; resuming from local checkpoint iteration %d", iteration
                )
        original(checkpoint_path)

    setattr(resume_start, _HOOK_MARK, True)
    connector.resume_start = resume_start


__all__ = ["FlashpointHierarchicalCheckpointIO", "global_step_of", "use_flashpoint_local_checkpoints"]
