"""The only CUDA shims the tests need to run megatron.core.dist_checkpointing on a CPU-only torch.

Megatron 0.15.3 creates small status tensors on torch.cuda.current_device() and calls
torch.cuda.synchronize() around async saves. On a machine without a GPU both are made
harmless here, in tests only; the library itself never patches torch.
"""

from __future__ import annotations

import torch


def install() -> None:
    if torch.cuda.is_available():
        return  # a real GPU: nothing to shim
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
