"""Deterministic test states and a bit-exact comparison, shared by tests and their child processes."""

from __future__ import annotations

from typing import Any, Mapping

import torch

COMMON_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def make_state(seed: int, *, large_tensors: int = 4, large_numel: int = 1 << 20, small_tensors: int = 200) -> dict:
    """A state of a few large and many small tensors plus a bytes item, fully determined by seed."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i in range(large_tensors):
        state[f"large.{i}"] = torch.randn(large_numel, generator=gen)
    for i in range(small_tensors):
        dtype = COMMON_DTYPES[i % len(COMMON_DTYPES)]
        numel = int(torch.randint(1, 512, (1,), generator=gen))
        raw = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), generator=gen,
                            dtype=torch.uint8)
        state[f"small.{i}"] = raw.view(dtype)
    state["extra"] = f"seed={seed}".encode()
    return state


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical order (conjugation and negation resolved)."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def assert_state_equal(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> None:
    """Same keys, and every value identical bit for bit (NaN payloads included)."""
    assert set(expected) == set(actual), f"keys differ: {set(expected) ^ set(actual)}"
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
            assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{key}: bytes differ"
        else:
            assert bytes(got) == bytes(want), f"{key}: bytes differ"
