"""Helpers for tests, examples and benchmarks on CPU-only machines. Not for production.

`ml_flashpoint_nemo.testing.cpu_shims` stands in for CUDA-only calls of Megatron-core and NeMo
so that their training and checkpointing code runs on a CPU-only torch. A real training job
never imports this package: on a machine with CUDA every shim is a no-op anyway.
"""
