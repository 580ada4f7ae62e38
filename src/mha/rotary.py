"""``apply_rotary``: rotary position embeddings (implemented in :mod:`mha.api.rotary`)."""

from .api.rotary import apply_rotary, check_rotary

__all__ = ["apply_rotary", "check_rotary"]
