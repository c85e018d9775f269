"""Counts the collectives a process makes and the bytes it receives through them (benchmarks/bench_scale.py).

install() replaces torch.distributed's collective functions (in torch.distributed and in
torch.distributed.distributed_c10d, where torch's own object collectives look them up) with
wrappers; it must run before the code under measure binds any of them by name. Calls are
counted only inside an open window (meter.window(name)), and only the outermost call: the
tensor collectives that all_gather_object makes inside itself are part of it, not extra calls.

What "received" means, per call, for the calling rank (group = the call's group):
- *_object collectives: the pickled sizes of the objects this rank gets from other ranks
  (pickle's default protocol, as torch serialises them); all_gather_object also gets
  `padded`: torch pads every rank's payload to the largest, so (group size - 1) x largest.
- tensor collectives: the bytes of the tensors other ranks' data lands in: all_reduce and
  reduce_scatter the output, all_gather / gather / all_to_all the other ranks' parts,
  broadcast / scatter / reduce the tensor unless this rank is the source.
- barrier, monitored_barrier, new_group, new_subgroups: 0 bytes (counted as collectives: every
  rank of the world calls new_group for every group; with TORCH_DIST_INIT_BARRIER=1 each call is
  a barrier of the world through the store, otherwise only a group's members meet).
Re-pickling received objects to size them costs time inside the measured call; it is
accumulated in `overhead_seconds` so that callers can take it off their timings.

Each call is also counted by its kind and the scope of its group (`by_scope`, "kind:scope"):
"world" (every rank), "node" (ranks of one node), "across" (at most one rank per node, e.g.
the node leaders) or "other"; nodes as the meter's node_of(rank) tells (else every subgroup is
"other"). A latency model charges each scope the steps of its own size (latency_steps).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# Which kind of algorithm a collective's latency scales with: "linear" ones take N-1 steps (a ring or a
# root that hears every rank), "tree" ones log2(N) steps.
LINEAR = "linear"
TREE = "tree"
COLLECTIVE_KINDS = {
    "all_gather_object": LINEAR, "gather_object": LINEAR, "scatter_object_list": LINEAR,
    "all_gather": LINEAR, "all_gather_into_tensor": LINEAR, "gather": LINEAR, "scatter": LINEAR,
    "reduce_scatter": LINEAR, "reduce_scatter_tensor": LINEAR, "all_to_all": LINEAR, "all_to_all_single": LINEAR,
    "broadcast_object_list": TREE, "all_reduce": TREE, "broadcast": TREE, "reduce": TREE, "barrier": TREE,
    "monitored_barrier": TREE, "new_group": TREE, "new_subgroups": TREE,
}
# The scope of a call's group: the whole world, one node's ranks, ranks of different nodes, anything else.
WORLD, NODE, ACROSS, OTHER = "world", "node", "across", "other"


@dataclass
class CallStats:
    """Totals of one collective function inside one window."""

    calls: int = 0
    received: int = 0
    padded: int = 0
    seconds: float = 0.0


@dataclass
class Window:
    """What one rank's collectives did between opening and closing a window."""

    name: str
    by_function: dict[str, CallStats] = field(default_factory=dict)
    overhead_seconds: float = 0.0
    unsized: int = 0  # received objects that could not be re-pickled to size them
    by_scope: dict[str, int] = field(default_factory=dict)  # calls per "kind:scope"

    def as_dict(self) -> dict[str, Any]:
        return {
            "collectives": sum(s.calls for s in self.by_function.values()),
            "received": sum(s.received for s in self.by_function.values()),
            "padded": sum(s.padded or s.received for s in self.by_function.values()),
            "seconds": round(sum(s.seconds for s in self.by_function.values()), 6),
            "overhead_seconds": round(self.overhead_seconds, 6),
            "unsized": self.unsized,
            "by_scope": dict(sorted(self.by_scope.items())),
            "by_function": {name: {"calls": s.calls, "received": s.received, "padded": s.padded or s.received,
                                   "seconds": round(s.seconds, 6), "kind": COLLECTIVE_KINDS[name]}
                            for name, s in sorted(self.by_function.items())},
        }


def _pickled_size(obj: Any) -> int | None:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an object torch could send but pickle cannot size again
        return None


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, torch.Tensor) else 0


def _group_size_and_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _is_source(args: dict[str, Any], key: str) -> bool:
    """Whether this rank is the call's src/dst (given as a global rank, or as group_src/group_dst)."""
    group_key = f"group_{key}"
    if args.get(group_key) is not None:
        return dist.get_rank(args.get("group")) == args[group_key]
    return dist.get_rank() == (args.get(key) or 0)


class CollectiveMeter:
    """Wraps torch.distributed's collectives (install) and sums what they do per open window."""

    def __init__(self, node_of: Callable[[int], int] | None = None) -> None:
        self.node_of = node_of  # a global rank's node, to tell a node's group from the leaders' (scope)
        self.windows: list[Window] = []
        self._open: Window | None = None
        self._local = threading.local()
        self._originals: dict[str, Callable[..., Any]] = {}

    # ---------------------------------------------------------------- installing

    def install(self) -> "CollectiveMeter":
        for name in COLLECTIVE_KINDS:
            original = getattr(distributed_c10d, name, None)
            if original is None:  # not in this torch
                continue
            wrapper = self._wrap(name, original)
            self._originals[name] = original
            setattr(distributed_c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        return self

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            window = self._open
            if window is None or getattr(self._local, "inside", False):
                return original(*args, **kwargs)
            self._local.inside = True
            started = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                self._local.inside = False
            elapsed = time.perf_counter() - started
            sizing = time.perf_counter()
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            received, padded = self._received(name, dict(bound.arguments), window)
            stats = window.by_function.setdefault(name, CallStats())
            stats.calls += 1
            stats.received += received
            stats.padded += padded
            stats.seconds += elapsed
            key = f"{COLLECTIVE_KINDS[name]}:{self.scope(bound.arguments.get('group'))}"
            window.by_scope[key] = window.by_scope.get(key, 0) + 1
            window.overhead_seconds += time.perf_counter() - sizing
            return result

        return counted

    def scope(self, group: Any) -> str:
        """WORLD, NODE, ACROSS or OTHER: which ranks the call's group holds (see the module's docstring)."""
        if group is None or group is dist.GroupMember.WORLD:
            return WORLD
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == dist.get_world_size():
            return WORLD
        if self.node_of is None:
            return OTHER
        nodes = [self.node_of(rank) for rank in ranks]
        if len(set(nodes)) == 1:
            return NODE
        return ACROSS if len(set(nodes)) == len(nodes) else OTHER

    # ---------------------------------------------------------------- windows

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[Window]:
        """Count the collectives made until the block ends (windows do not nest)."""
        assert self._open is None, f"window {name!r} opened inside {self._open.name!r}"
        self._open = Window(name)
        try:
            yield self._open
        finally:
            self.windows.append(self._open)
            self._open = None

    # ---------------------------------------------------------------- sizing

    def _received(self, name: str, a: dict[str, Any], window: Window) -> tuple[int, int]:
        """(bytes this rank received, bytes on the wire where torch pads) of one finished call."""
        if name in ("barrier", "monitored_barrier", "new_group", "new_subgroups"):
            return 0, 0
        size, me = _group_size_and_rank(a.get("group"))
        if name == "all_gather_object":
            return self._objects_received(a["object_list"], me, window, pad_to_largest=True)
        if name == "gather_object":
            if not _is_source(a, "dst") or a.get("object_gather_list") is None:
                return 0, 0
            return self._objects_received(a["object_gather_list"], me, window)
        if name == "broadcast_object_list":
            return (0, 0) if _is_source(a, "src") else self._objects_received(a["object_list"], None, window)
        if name == "scatter_object_list":
            return (0, 0) if _is_source(a, "src") else self._objects_received(a["scatter_object_output_list"][:1],
                                                                            None, window)
        return self._tensors_received(name, a, size, me), 0

    def _objects_received(self, objects: list[Any], own_index: int | None, window: Window, *,
                          pad_to_largest: bool = False) -> tuple[int, int]:
        sizes = []
        for index, obj in enumerate(objects):
            size = _pickled_size(obj)
            if size is None:
                window.unsized += 1
                size = 0
            sizes.append((index, size))
        received = sum(size for index, size in sizes if index != own_index)
        others = sum(1 for index, _ in sizes if index != own_index)
        padded = others * max((s for _, s in sizes), default=0) if pad_to_largest else received
        return received, padded

    @staticmethod
    def _tensors_received(name: str, a: dict[str, Any], size: int, me: int) -> int:
        if name in ("all_reduce", "reduce_scatter"):
            return _nbytes(a.get("tensor", a.get("output")))
        if name == "reduce_scatter_tensor":
            return _nbytes(a["output"])
        if name == "all_gather":
            return sum(_nbytes(t) for t in a["tensor_list"]) - _nbytes(a["tensor"])
        if name == "all_gather_into_tensor":
            return _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])
        if name == "gather":
            if not _is_source(a, "dst") or not a.get("gather_list"):
                return 0
            return sum(_nbytes(t) for t in a["gather_list"]) - _nbytes(a["tensor"])
        if name in ("broadcast", "scatter"):
            return 0 if _is_source(a, "src") else _nbytes(a["tensor"])
        if name == "reduce":
            return _nbytes(a["tensor"]) if _is_source(a, "dst") else 0
        if name == "all_to_all":
            return sum(_nbytes(t) for i, t in enumerate(a["output_tensor_list"]) if i != me)
        if name == "all_to_all_single":
            return _nbytes(a["output"]) * (size - 1) // max(1, size)
        return 0


def scope_size(scope: str, ranks: int, nodes: int) -> int:
    """The ranks a group of this scope holds in a job of ranks on nodes: g = ranks / nodes, nodes, or all."""
    return {NODE: max(1, ranks // max(1, nodes)), ACROSS: nodes}.get(scope, ranks)


def latency_steps(kind: str, world_size: int) -> float:
    """Steps of the latency model in a group of world_size: N-1 for linear collectives, ceil(log2 N) for tree ones."""
    if world_size <= 1:
        return 0.0
    if kind == LINEAR:
        return float(world_size - 1)
    return float(max(1, (world_size - 1).bit_length()))
