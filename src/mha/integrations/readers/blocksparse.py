"""The rows of block-sparse top-k attention: MiniMax-M3's sparse layers, whose lightning
indexer picks, per group of heads, the blocks of keys each query attends to
(:class:`mha.BlockSparseAttention`, :mod:`mha.api.block_sparse`); and Qwen4-Exp's attention
layers, whose QSA indexer picks blocks of averaged keys for all heads (:mod:`mha.api.qsa`).

A layer is sparse where ``layer_types`` says ``"minimax_m3_sparse"`` (else, in older configs,
where ``sparse_attention_config["sparse_attention_freq"]`` is true); the others are dense
attention. The indexer's settings are ``index_n_heads``, ``index_head_dim``,
``index_block_size``, ``index_topk_blocks`` and ``index_local_blocks`` (in older configs
``sparse_attention_config``'s ``sparse_num_index_heads``, ``sparse_index_dim``,
``sparse_block_size``, ``sparse_topk_blocks`` and ``sparse_local_block``); its tensors sit
under the attention's ``indexer.`` (``q_proj``, ``k_proj``, ``q_norm``, ``k_norm``). Its
RMSNorms, as the layer's QK-norm, weigh by ``1 + weight``; it rotates its first features as
the layer's keys are rotated (the width of ``partial_rotary_factor``: transformers' rotary
embedding does not read ``rotary_dim``).

Qwen4-Exp's attention is Qwen3.5's (a sigmoid gate of every feature fused into ``q_proj``,
QK-norm of ``1 + weight``, a partial rope, its multimodal rope read as the rope of text) with
the QSA indexer of ``indexer_n_heads``, ``indexer_kv_heads`` (1), ``indexer_head_dim``,
``indexer_budget`` and ``indexer_compress_ratio``, its tensors under ``indexer.``
(``index_qk_proj``, ``q_layernorm``, ``k_layernorm``), in its ``indexed_attention`` layers
(``full_attention`` in the released configs); its ``linear_attention`` layers are Gated
DeltaNet, refused by their index.

>>> [row.name for row in ROWS]
['minimax_m3_vl_text', 'qwen4_exp_text']
"""

from __future__ import annotations

from typing import Any

from ...api.block_sparse import BlockIndexerSpec
from ...api.qsa import QSAIndexerSpec
from .config import FULL, Settings
from .family import Family, QkNorm
from .gated import QueryGate, every_interval
from .hybrid import LINEAR, Hybrid, from_layer_types
from .layouts import NO_BIASES, Tensor, whole
from .rope import Rope

__all__ = ["MINIMAX_M3", "QWEN4_EXP", "ROWS", "indexer_tensors"]

SPARSE = "minimax_m3_sparse"
_LEGACY = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
"""The indexer's config keys, and their names in an older ``sparse_attention_config``."""

MINIMAX_M3: dict[str, Any] = {
    "hidden_size": 6144,
    "num_hidden_layers": 60,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 524288,
    "layer_types": None,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
}

_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
        "indexer_compress_ratio")  # fmt: skip
QWEN4_EXP: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "layer_types": None,
    **dict.fromkeys(_QSA),
}
INDEXED = "indexed_attention"


def _setting(read: Settings, key: str) -> Any:
    """``key``'s value: ``config.json``'s, else its older ``sparse_attention_config``'s,
    else the class's default."""
    given = read.given(key)
    if given is not None:
        return read.get(key)
    legacy = read.given("sparse_attention_config") or {}
    if isinstance(legacy, dict) and _LEGACY[key] in legacy:
        return legacy[_LEGACY[key]]
    return read.get(key)


def _positive(read: Settings, key: str, zero: bool = False) -> int:
    value = _setting(read, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise read.refuse(f"{read.name(key)}={value!r} (the block indexer needs a count)")
    return value


def _sparse(read: Settings, index: int) -> bool:
    """Whether layer ``index`` is sparse: ``layer_types``' entry, else the older
    ``sparse_attention_freq``'s."""
    kinds = read.get("layer_types")
    if kinds is None:
        legacy = read.given("sparse_attention_config") or {}
        freq = legacy.get("sparse_attention_freq") if isinstance(legacy, dict) else None
        return bool(freq is not None and index < len(freq) and freq[index])
    kind = kinds[index] if isinstance(kinds, list) and index < len(kinds) else None
    if kind not in (SPARSE, "full_attention"):
        raise read.refuse(
            f"{read.name('layer_types')}[{index}]={kind!r} (the layer kinds are {SPARSE!r} "
            "and 'full_attention')"
        )
    return bool(kind == SPARSE)


def _indexer(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Layer ``index``'s block indexer, where it is sparse."""
    if not _sparse(read, index):
        return {}
    n, d = _positive(read, "index_n_heads"), _positive(read, "index_head_dim")
    H = settings["num_heads"]
    if H % n:
        raise read.refuse(
            f"{read.name('index_n_heads')}={n}, which does not divide its {H} heads "
            "(transformers spreads each indexer head's choice over H / index_n_heads heads)"
        )
    rotated = settings["rotary_dim"] or settings["head_dim"]
    if settings["rope_theta"] is not None and d < rotated:
        raise read.refuse(
            f"{read.name('index_head_dim')}={d} narrower than the {rotated} rotated features "
            "(its indexer would rotate its features by the first index_head_dim cosines, "
            "which pair them otherwise)"
        )
    spec = BlockIndexerSpec(
        _positive(read, "index_block_size"),
        _positive(read, "index_topk_blocks"),
        _positive(read, "index_local_blocks", zero=True),
        n,
        d,
        float(read.get("rms_norm_eps")),
        1.0,
    )
    return {"block_indexer": spec}


def _qsa(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The QSA indexer of an attention layer (every one has it)."""
    values = {key: read.get(key) for key in _QSA}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise read.refuse(
                f"{read.name(key)}={value!r} (Qwen4-Exp's attention always has its QSA "
                "indexer, which needs positive indexer_n_heads, indexer_kv_heads, "
                "indexer_head_dim, indexer_budget and indexer_compress_ratio)"
            )
    if values["indexer_kv_heads"] != 1:
        raise read.refuse(f"{read.name('indexer_kv_heads')}={values['indexer_kv_heads']} (1 only)")
    budget, c = values["indexer_budget"], values["indexer_compress_ratio"]
    if budget % c:
        raise read.refuse(
            f"{read.name('indexer_budget')}={budget} not a multiple of "
            f"{read.name('indexer_compress_ratio')}={c}"
        )
    d = values["indexer_head_dim"]
    rotated = settings["rotary_dim"] or settings["head_dim"]
    if settings["rope_theta"] is not None and d < rotated:
        raise read.refuse(
            f"{read.name('indexer_head_dim')}={d} narrower than the {rotated} rotated features"
        )
    eps = float(read.get("rms_norm_eps"))
    return {"block_indexer": QSAIndexerSpec(budget, c, values["indexer_n_heads"], d, eps, 1.0)}


def _qwen4_types(read: Settings, count: int) -> list[str]:
    """Qwen4-Exp's layer types: ``layer_types`` (its ``full_attention`` layers indexed), else
    every ``full_attention_interval``-th layer indexed (4 by default)."""
    types = read.get("layer_types")
    kinds = every_interval(read, count) if types is None else from_layer_types()(read, count)
    return [INDEXED if kind == FULL else kind for kind in kinds]


def indexer_tensors(spec: BlockIndexerSpec | QSAIndexerSpec, d_model: int) -> dict[str, Tensor]:
    """The indexer's tensors under the attention, for inputs ``d_model`` wide."""
    n, d = spec.num_heads, spec.head_dim
    if isinstance(spec, QSAIndexerSpec):
        return {
            "indexer.index_qk_proj.weight": whole("W_index_qk", (n + 1) * d, d_model),
            "indexer.q_layernorm.weight": whole("index_q_norm", d),
            "indexer.k_layernorm.weight": whole("index_k_norm", d),
        }
    return {
        "indexer.q_proj.weight": whole("W_index_q", n * d, d_model),
        "indexer.k_proj.weight": whole("W_index_k", d, d_model),
        "indexer.q_norm.weight": whole("index_q_norm", d),
        "indexer.k_norm.weight": whole("index_k_norm", d),
    }


ROWS: tuple[Family, ...] = (
    Family(
        "minimax_m3_vl_text",
        MINIMAX_M3,
        biases=NO_BIASES,
        rope=Rope(theta=5e6, partial=True),
        qk_norm=QkNorm("head", offset=1.0),
        by_layer=_indexer,
    ),
    Family(
        "qwen4_exp_text",
        QWEN4_EXP,
        rope=Rope(partial=True, text_mrope=True),
        qk_norm=QkNorm("head", offset=1.0),
        gate=QueryGate(),
        hybrid=Hybrid(
            "Qwen4-Exp",
            _qwen4_types,
            {LINEAR: "a Gated DeltaNet linear-attention layer"},
            attention=(INDEXED,),
        ),
        by_layer=_qsa,
    ),
)
