"""The table: one row (:class:`~.family.Family`) per ``model_type`` mha reads, as vLLM's
model registry maps an architecture to the class that runs it. A family that differs from
another by names and defaults is one more row; one that computes something new is one small
function (a window rule, a scale) and a row that names it. Rows registered later
(:func:`register`) are read the same way.

>>> SUPPORTED[:4]
('llama', 'mistral', 'qwen2', 'qwen3')
>>> FAMILIES["phi3"].tensors.qkv, FAMILIES["phi3"].rope.aliases["su"]
('qkv_proj', 'longrope')
"""

from __future__ import annotations

from typing import Any

from ...errors import AttentionValueError
from . import defaults
from .config import FULL, SLIDING
from .family import ACROSS_HEADS, BIDIRECTIONAL, PER_HEAD, Family, QkNorm, query_pre_attn_scalar
from .layouts import FUSED_QKV, LATENT, NO_BIASES, QKV_BIASES
from .refused import REFUSED
from .rope import Rope
from .windows import EVERY_LAYER, QWEN_WINDOWS, SLIDING_IF_WINDOWED, by_layer_types

__all__ = ["FAMILIES", "REFUSED", "SUPPORTED", "family_of", "register"]

FAMILIES: dict[str, Family] = {}
"""The families read, by ``model_type``."""


def register(*families: Family) -> None:
    """Adds rows to the table (a later row of the same ``model_type`` replaces the first)."""
    FAMILIES.update((family.name, family) for family in families)


register(
    Family("llama", defaults.LLAMA),
    Family("mistral", defaults.MISTRAL, biases=NO_BIASES, windows=EVERY_LAYER),
    Family("qwen2", defaults.QWEN2, biases=QKV_BIASES, windows=QWEN_WINDOWS),
    Family("qwen3", defaults.QWEN3, windows=QWEN_WINDOWS, qk_norm=PER_HEAD),
    Family(
        "gemma2",
        defaults.GEMMA2,
        windows=by_layer_types(pattern=2),
        scale=query_pre_attn_scalar,
        softcap="attn_logit_softcapping",
        unsupported=(BIDIRECTIONAL,),
    ),
    Family(
        "gemma3_text",
        defaults.GEMMA3_TEXT,
        windows=by_layer_types(pattern=6),
        rope=Rope(
            per_layer_type={FULL: ("rope_theta", 1e6), SLIDING: ("rope_local_base_freq", 1e4)}
        ),
        scale=query_pre_attn_scalar,
        qk_norm=QkNorm("head", offset=1.0),
        unsupported=(BIDIRECTIONAL,),
    ),
    Family("olmo2", defaults.OLMO2, qk_norm=ACROSS_HEADS),
    Family(
        "phi3",
        defaults.PHI3,
        tensors=FUSED_QKV,
        biases=NO_BIASES,
        windows=EVERY_LAYER,
        rope=Rope(partial=True, fraction=1.0, aliases={"su": "longrope", "yarn": "longrope"}),
    ),
    Family(
        "gpt_oss",
        defaults.GPT_OSS,
        windows=by_layer_types(pattern=2),
        rope=Rope(theta=150_000.0, parameters=defaults.GPT_OSS_ROPE),
        sinks=True,
    ),
    # DeepSeek V2 rotates (2i, 2i + 1) pairs as complex numbers; V3 as rope_interleave says
    Family("deepseek_v2", defaults.DEEPSEEK_V2, tensors=LATENT, rope=Rope(interleave=True)),
    Family(
        "deepseek_v3", defaults.DEEPSEEK_V3, tensors=LATENT, rope=Rope(interleave="rope_interleave")
    ),
    # Mistral's attention under other names: by layer_types, or a window that may be null
    Family("ministral", defaults.MINISTRAL, biases=NO_BIASES, windows=SLIDING_IF_WINDOWED),
    Family(
        "mixtral", defaults.MIXTRAL, biases=NO_BIASES, windows=EVERY_LAYER, rope=Rope(theta=1e6)
    ),
    Family("arcee", defaults.ARCEE),  # Llama's attention (its MLP differs)
)

SUPPORTED = tuple(FAMILIES)
"""The families of the table as mha defines it (before any :func:`register`)."""


def family_of(config: dict[str, Any], path: Any) -> Family:
    """The row of ``config``'s ``model_type``, or a refusal that names it and the reason."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family
    reason = "config.json names no model_type"
    if isinstance(model_type, str):
        reason = REFUSED.get(model_type, "it is not supported")
    raise AttentionValueError(
        f"{path}: model_type {model_type!r}: {reason}; the model types mha reads are "
        f"{', '.join(FAMILIES)}"
    )
