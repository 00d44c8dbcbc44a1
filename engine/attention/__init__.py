"""Attention backends behind one interface (see `backend.py`)."""
from engine.attention.backend import (
    BACKEND_NAMES,
    AttentionBackend,
    default_backend_name,
    get_attention_backend,
)
from engine.attention.metadata import AttentionMetadata
from engine.attention.paged import gather_kv, store_kv
from engine.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "default_backend_name",
    "gather_kv",
    "get_attention_backend",
    "store_kv",
]
