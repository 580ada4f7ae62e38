"""The small pieces the rows of the table (:mod:`.registry`) name: each family's own config
key names, a scale or a rope rule read from its config, a refusal of one family's option,
a hybrid's layer pattern. A row names one of these where its family computes something a
field's default does not say.
"""

from __future__ import annotations

from .config import FULL, SLIDING, Settings, Unsupported
from .family import (
    QkNorm,
    from_config,
    split_hidden,
)
from .hybrid import (
    LINEAR,
    MLP,
    MOE,
)
from .layouts import (
    Biases,
    Projections,
)
from .rope import (
    Rope,
)

__all__ = [
    "ALWAYS",
    "DBRX_BASE",
    "DBRX_KEYS",
    "GPT2_KEYS",
    "GPT_NEO_KEYS",
    "HUNYUAN",
    "HUNYUAN_NORM",
    "LARA_MINI",
    "MAMBA",
    "MAMBA2",
    "MPT_KEYS",
    "MPT_UNSUPPORTED",
    "NEOX_ROPE_KEYS",
    "NO_ROPE",
    "PATTERN",
    "ROTARY_DIM",
    "XGLM_KEYS",
    "DbrxBase",
    "dbrx_heads",
    "key_multiplier",
    "laguna_gate_per_head",
    "lara_mini_types",
    "rope_position_embedding",
    "rope_unless_null",
    "scale_attn_weights",
    "softmax_scale",
]

GPT2_KEYS = {
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "max_position_embeddings": "n_positions",
}
GPT_NEO_KEYS = {
    "num_attention_heads": "num_heads",
    "num_hidden_layers": "num_layers",
    "layer_types": "attention_layers",
}
NEOX_ROPE_KEYS = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}
MPT_KEYS = {
    "num_attention_heads": "n_heads",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
}
XGLM_KEYS = {
    "num_attention_heads": "attention_heads",
    "hidden_size": "d_model",
    "num_hidden_layers": "num_layers",
}
ALWAYS = Biases()
"""Every projection biased (GPT-2's ``Conv1D``, BLOOM's, BioGPT's)."""
NO_ROPE = Rope(applied=False)
MPT_UNSUPPORTED = (
    # transformers' MPT builds its ALiBi without them: slopes of alibi_bias_max=8, always
    Unsupported(
        "attn_config.alibi_bias_max",
        "ALiBi slopes of another alibi_bias_max, which transformers' MPT ignores (it takes 8)",
        lambda value: value != 8,
    ),
    Unsupported(
        "attn_config.alibi",
        "no ALiBi, which transformers' MPT applies all the same",
        lambda value: not value,
    ),
)
ROTARY_DIM = Rope(interleave=True, dim_key="rotary_dim")
HUNYUAN = Projections(q_norm="query_layernorm", k_norm="key_layernorm")
HUNYUAN_NORM = QkNorm("head", after_rope=True)
DBRX_KEYS = {
    **MPT_KEYS,
    "num_key_value_heads": "attn_config.kv_n_heads",
    "max_position_embeddings": "max_seq_len",
}


def softmax_scale(read: Settings) -> float | None:
    """MPT's ``attn_config.softmax_scale`` (``None``: ``1/sqrt(head_dim)``)."""
    scale = read.get("attn_config.softmax_scale")
    return None if scale is None else float(scale)


def scale_attn_weights(read: Settings) -> float | None:
    """GPT-2's: ``1/sqrt(head_dim)``, or 1 without ``scale_attn_weights``."""
    return None if read.get("scale_attn_weights") else 1.0


def key_multiplier(read: Settings) -> float:
    """Falcon-H1's: ``1/sqrt(head_dim)`` times ``key_multiplier``, which multiplies its keys
    (the scores are the same)."""
    scale: float = from_config(read)[2] ** -0.5 * float(read.get("key_multiplier"))
    return scale


def rope_unless_null(read: Settings, index: int, layer_type: str) -> bool:
    """OLMo-hybrid's: a rope unless its base is null (``rope_parameters``' ``rope_theta``,
    or the older top-level one), as in its released checkpoints."""
    parameters = read.given("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return parameters["rope_theta"] is not None
    return not ("rope_theta" in read.config and read.config["rope_theta"] is None)


def rope_position_embedding(read: Settings, index: int, layer_type: str) -> bool:
    """Granite-MoE-hybrid's: a rope when ``position_embedding_type`` is ``"rope"``, else no
    positions (its default)."""
    return bool(read.get("position_embedding_type") == "rope")


LARA_MINI = [LINEAR, SLIDING, LINEAR, FULL, SLIDING]
"""Lara-mini's default layer types, repeated (its released pattern)."""


def lara_mini_types(read: Settings, count: int) -> list[str]:
    """Lara-mini's default ``layer_types``: its released pattern of five, repeated."""
    return [LARA_MINI[i % len(LARA_MINI)] for i in range(count)]


MAMBA = "a Mamba layer"
MAMBA2 = "a Mamba-2 layer"
PATTERN = {"M": LINEAR, "E": MOE, "*": FULL, "-": MLP}
"""Nemotron-H's ``hybrid_override_pattern``: a character a layer."""


class DbrxBase(Unsupported):
    """DBRX's ``attn_config.rope_theta``, which transformers' DBRX keeps but does not rotate
    by (its rotary takes ``rope_parameters``' base, 10000 by default): refused where the two
    differ, as mha would rotate by the base that transformers does not."""

    def check(self, read: Settings) -> None:
        value = read.get(self.key)
        rope = read.get("rope_parameters") or {}
        base = rope.get("rope_theta", 10_000.0) if isinstance(rope, dict) else None
        if value is not None and value != base:
            raise read.refuse(
                f"{read.name(self.key)}={value!r} ({self.feature}: it rotates by "
                f"rope_parameters' rope_theta={base!r})"
            )


DBRX_BASE = DbrxBase("attn_config.rope_theta", "a rotary base transformers' DBRX ignores")


def laguna_gate_per_head(read: Settings) -> bool:
    """Laguna's ``gating``: a gate per head when ``true`` or ``"per-head"``, else one per
    feature."""
    gating = read.get("gating")
    return gating is True or gating == "per-head"


def dbrx_heads(read: Settings) -> tuple[int, int, int]:
    """DBRX's: ``attn_config.kv_n_heads`` key/value heads, each head ``d_model // n_heads``
    wide."""
    return split_hidden(read, read.positive("num_key_value_heads"))
