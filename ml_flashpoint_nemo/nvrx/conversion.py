"""Megatron's conversion to a tensor-aware state dict, its sharding check run when the sharding changed only.

``MCoreTensorAwareStateDict.from_state_dict`` (what NeMo's hierarchical IO calls before every local
save) checks the sharding's integrity unless it is handed cached metadata: it broadcasts rank 0's
common state dict, all-gathers every rank's shard metadata (ranks x shards objects, pickled) and
rank 0 alone checks that the main replicas cover every tensor once, raising on rank 0 alone when
they do not. With ``fully_parallel`` it then all-gathers the shards again to choose which rank
saves each replicated one. NeMo's own IO never fills its cache, so every save pays both; NeMo's
global saves (``MegatronCheckpointIO``) check the first save only, and Megatron-LM caches only
with ``--ckpt-assume-constant-structure``, trusting that nothing changes.

``TensorAwareConversion`` runs the same check, and the distribution, on the first save and again
whenever any rank's sharding (every field of every shard but its data) differs from the last save
checked; a steady save costs one all-reduce of 16 bytes instead. A sharding the check rejects, or
a state dict that cannot be converted on some rank, raises ``InvalidShardingError`` on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any, Callable

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.exchange_utils import determine_main_replica_uniform_distribution
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

from ml_flashpoint_nemo.core.topology import problems_of_every_rank, reduced_ints
from ml_flashpoint_nemo.nvrx.manager import LocalCheckpointingError

logger = logging.getLogger(__name__)

ALGORITHMS = ("atomic", "fully_parallel")
# What from_state_dict computes as the distribution of "atomic": handed back as cached metadata, it
# only tells from_state_dict that the check was done.
_ATOMIC_DISTRIBUTION = (None, None, None, None)

Sharding = tuple[tuple[Any, ...], ...]


class InvalidShardingError(LocalCheckpointingError):
    """The sharded state dict to save does not shard its tensors correctly, or cannot be converted on some rank."""


def sharding_of(sharded_part: Any) -> Sharding:
    """What Megatron's check and distribution read of each shard, in order: every field but the data."""
    return tuple((type(shard), *(getattr(shard, name) for name in _fields(type(shard))))
                 for shard in nested_values(sharded_part))


_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(kind: type) -> tuple[str, ...]:
    """The dataclass fields of a shard type but its data (ShardedTensor, ShardedObject), looked up once."""
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind) if f.name != "data")
    return names


class TensorAwareConversion:
    """``from_state_dict(state, algo, parallelization_group)``, checked on the first save and after a sharding change.

    Collective: every rank calls it for every save. ``checks`` counts the saves that ran
    Megatron's sharding check (and, with ``fully_parallel``, computed the distribution).
    """

    def __init__(self, algo: str = "fully_parallel", parallelization_group: Any = None) -> None:
        if algo not in ALGORITHMS:
            raise LocalCheckpointingError(f"local checkpoint algorithm {algo!r} is not one of {ALGORITHMS}")
        self.algo = algo
        self.parallelization_group = parallelization_group
        self.checks = 0
        self._checked: Sharding | None = None  # this rank's sharding of the last save checked
        self._distribution: Any = None  # fully_parallel's distribution of that save (None: a group of one)

    def __call__(self, sharded_state_dict: Any) -> MCoreTensorAwareStateDict:
        converted, sharding, problem = None, None, None
        try:  # nothing here may raise on this rank alone: the others would wait in the all-reduce below
            converted, _ = MCoreTensorAwareStateDict.from_state_dict(
                sharded_state_dict, algo="atomic", cached_metadata=_ATOMIC_DISTRIBUTION
            )
            sharding = sharding_of(converted.sharded_state_dict)
        except Exception as exc:  # noqa: BLE001 - told to every rank by the all-reduce below
            problem = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
        changed, failed = reduced_ints([int(sharding != self._checked), int(problem is not None)])
        if failed:
            raise InvalidShardingError(
                "the state dict to save cannot be converted for a local checkpoint; nothing was saved. Fix what "
                "the ranks named report in the model's or optimizer's sharded_state_dict: "
                + "; ".join(problems_of_every_rank(problem))
            )
        assert converted is not None and sharding is not None
        if changed:
            self._check(converted, sharding)
        if self.algo == "atomic" or self._distribution is None:
            return converted
        # The shards of other ranks' saves come out of this rank's (their data set to None).
        fully_parallel, _ = MCoreTensorAwareStateDict.from_state_dict(
            sharded_state_dict,
            algo=self.algo,
            parallelization_group=self.parallelization_group,
            cached_metadata=self._distribution,
        )
        return fully_parallel

    def _check(self, converted: MCoreTensorAwareStateDict, sharding: Sharding) -> None:
        """Collective: Megatron's sharding check (and fully_parallel's distribution); raises on every rank alike."""
        first = self._checked is None
        self._checked, self._distribution = None, None
        shards = converted.sharded_state_dict
        # What determine_global_metadata all-gathers, pickled first: failing inside its all_gather_object would
        # raise on this rank alone while the others wait there.
        _on_every_rank(lambda: pickle.dumps([shard.without_data() for shard in nested_values(shards)]),
                       "the shards' metadata (key, shape, offset, replica id) cannot be pickled for Megatron's "
                       "sharding check; nothing was saved. Fix the values the ranks named report: ")
        # Megatron raises on rank 0 alone.
        _on_every_rank(lambda: validate_sharding_integrity(determine_global_metadata(shards)[1],
                                                           common_state_dict=converted.common),
                       "the sharded state dict to save does not shard its tensors correctly (Megatron's check: each "
                       "tensor's main replicas must cover it exactly once); nothing was saved. Fix the model's or "
                       "optimizer's sharded_state_dict, or the parallel settings: ")
        distribution: Any = None
        if self.algo == "fully_parallel":
            distribution = _on_every_rank(
                lambda: determine_main_replica_uniform_distribution(shards, self.parallelization_group, True),
                "choosing which rank saves each replicated shard failed; nothing was saved: ")
        self._checked, self._distribution = sharding, distribution
        self.checks += 1
        if not first:
            logger.info("The sharding of the state dict changed since the last local save: checked it again")


def _on_every_rank(action: Callable[[], Any], what: str) -> Any:
    """Collective: action()'s result; if it failed on any rank, InvalidShardingError on every rank (what + each error)."""
    result, problem = None, None
    try:
        result = action()
    except Exception as exc:  # noqa: BLE001 - every rank learns it below
        problem = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    failed = problems_of_every_rank(problem)
    if failed:
        raise InvalidShardingError(what + "; ".join(failed))
    return result


__all__ = ["InvalidShardingError", "TensorAwareConversion", "sharding_of"]
