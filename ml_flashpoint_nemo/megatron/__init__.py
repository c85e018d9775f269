"""Megatron-core adapter: dist_checkpointing save/load strategies for RAM versions."""

from ml_flashpoint_nemo.megatron.strategies import BACKEND, FlashpointLoadStrategy, FlashpointSaveStrategy

__all__ = ["BACKEND", "FlashpointLoadStrategy", "FlashpointSaveStrategy"]
