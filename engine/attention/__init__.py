"""Attention backends behind one interface (see `backend.py`)."""
from engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
