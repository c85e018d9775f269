"""What can be stored: tensors of any dtype and bytes, described without pickle."""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from ml_flashpoint_nemo.errors import UnsupportedValueError

BytesLike = Union[bytes, bytearray, memoryview]
StateValue = Union[torch.Tensor, BytesLike]
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
# Quantized dtypes carry scale/zero point outside their bytes; raw bytes alone would load wrong values.
QUANTIZED_DTYPES = frozenset(
    d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")) if d is not None
)


@dataclass
class PreparedValue:
    """A value ready to be copied: its bytes, its dtype name and shape."""

    key: str
    kind: str  # "tensor" or "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    tensor: torch.Tensor | None = None  # conjugation/negation resolved
    data: memoryview | None = None

    @property
    def is_direct(self) -> bool:
        """True when the bytes can be read straight from host memory by the C++ engine."""
        return self.tensor is not None and self.tensor.device.type == "cpu" and self.tensor.is_contiguous()


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # a dict lookup per record on the load path, not str() each time


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@functools.lru_cache(maxsize=None)
def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedValueError(
            f"stored dtype {name!r} is not known to torch {torch.__version__}; load with the torch that saved it"
        )
    return dtype


def prepare_value(key: Any, value: Any) -> PreparedValue:
    """Check that value can be stored under key and describe its bytes."""
    if not isinstance(key, str):
        raise UnsupportedValueError(f"state keys must be str, got {type(key).__name__} {key!r}")
    if type(value) in _PLAIN_TENSOR_TYPES:
        return _prepare_tensor(key, value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        view = memoryview(value)
        if not view.contiguous:
            raise UnsupportedValueError(f"value of {key!r} is a non-contiguous memoryview; pass bytes(...) instead")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        return PreparedValue(key, "bytes", "uint8", (view.nbytes,), view.nbytes, data=view)
    if isinstance(value, torch.Tensor):
        raise UnsupportedValueError(
            f"value of {key!r} is a {type(value).__name__}; the core stores plain tensors only. "
            "Use the DCP or Megatron adapter for distributed tensor types."
        )
    raise UnsupportedValueError(
        f"value of {key!r} is a {type(value).__name__}; only torch.Tensor and bytes can be stored. "
        "Serialize other objects to bytes first (the DCP and Megatron adapters do this for you)."
    )


def _prepare_tensor(key: str, tensor: torch.Tensor) -> PreparedValue:
    if tensor.layout != torch.strided:
        raise UnsupportedValueError(f"value of {key!r} has layout {tensor.layout}; convert it with .to_dense() first")
    if tensor.is_quantized or tensor.dtype in QUANTIZED_DTYPES:
        raise UnsupportedValueError(
            f"value of {key!r} is a quantized tensor; store int_repr(), scale and zero point separately"
        )
    if tensor.device.type == "meta":
        raise UnsupportedValueError(f"value of {key!r} is on the meta device and has no data to save")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    nbytes = tensor.numel() * tensor.element_size()
    return PreparedValue(key, "tensor", dtype_name(tensor.dtype), tuple(tensor.shape), nbytes, tensor=tensor)


def prepare_state(state: Mapping[str, Any]) -> list[PreparedValue]:
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"state must be a mapping of str to tensors or bytes, got {type(state).__name__}")
    return [prepare_value(k, v) for k, v in state.items()]


@dataclass(frozen=True)
class TensorColumns:
    """A state whose values are all plain, dense, contiguous CPU tensors, kept as columns.

    What a training state on the CPU mostly is. Columns are built from a handful of tensor
    attributes per value and compare as whole lists, so a save of thousands of tensors spends
    about a microsecond on each (prepare_state builds a PreparedValue per value: three times that).
    """

    keys: list[str]
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    nbytes: list[int]
    addresses: array.array  # data_ptr() of each tensor, as uint64

    def layout_key(self) -> tuple[list[str], list[torch.dtype], list[torch.Size], list[int]]:
        """Everything an object's layout depends on: equal keys mean an equal plan."""
        return self.keys, self.dtypes, self.shapes, self.nbytes

    def signature(self) -> list[tuple[str, str, str, tuple[int, ...], int]]:
        """(key, kind, dtype name, shape, nbytes) of each value, as prepare_state describes them."""
        return [(k, "tensor", dtype_name(d), tuple(s), n) for k, d, s, n in zip(*self.layout_key())]


_STRIDED = torch.strided


def tensor_columns(state: Mapping[str, Any]) -> TensorColumns | None:
    """The state as TensorColumns, or None when any key or value needs prepare_state.

    None for anything else than str keys and plain dense contiguous CPU tensors without
    conjugate or negative bits: bytes, device, strided, quantized, meta or sparse values, and
    non-mappings. prepare_state then describes (or refuses) the state value by value.
    """
    if not isinstance(state, Mapping):
        return None
    keys = list(state)
    values = list(state.values())
    for key, value in zip(keys, values):
        if (
            type(value) not in _PLAIN_TENSOR_TYPES
            or not isinstance(key, str)
            or value.layout is not _STRIDED
            or not value.is_cpu
            or value.is_quantized
            or not value.is_contiguous()
            or value.is_conj()
            or value.is_neg()
        ):
            return None
    return TensorColumns(
        keys,
        [v.dtype for v in values],
        [v.shape for v in values],
        [v.nbytes for v in values],
        array.array("Q", [v.data_ptr() for v in values]),
    )
