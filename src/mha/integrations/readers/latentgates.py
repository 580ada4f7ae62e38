"""The latent attentions with an output gate beside sparse top-k attention (issue 33):
DeepSeek's multi-head latent attention (:class:`mha.LatentAttention`) whose keys a
lightning indexer picks (DSA, :mod:`.sparse`), its joined heads gated before ``o_proj``.

* A.X-K2: ``q_gate_proj`` (saved as ``q_b_proj``) reads the query latent after and before
  its RMSNorm, ``[norm(a), a]``, and gives each head's query then its sigmoid gate, one a
  feature (:attr:`.LatentProjections.query_gate`); the indexer reads ``norm(a)``.

>>> [row.name for row in ROWS]
['axk2']
"""

from __future__ import annotations

from typing import Any

from .family import Family
from .rope import Rope
from .sparse import DEEPSEEK_V32, IndexedLatentProjections

__all__ = ["AXK2", "ROWS"]

AXK2: dict[str, Any] = {
    **DEEPSEEK_V32,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 128,
    "q_lora_rank": 384,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "max_position_embeddings": 131072,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 16,
}

ROWS: tuple[Family, ...] = (
    Family(  # DeepSeek-V3.2's indexer; the query and its gate fused in q_gate_proj
        "axk2",
        AXK2,
        tensors=IndexedLatentProjections(query_gate=True),
        rope=Rope(interleave=True),
    ),
)
"""The rows of these families, registered by :mod:`.registry`."""
