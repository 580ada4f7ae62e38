"""Dory (issue 33): nGPT's attention in looped layers.

* Its attention: unit queries and keys (each head's L2 norm, ``x / sqrt(sum(x²) + 1e-6)``,
  read as the QK-norm of each head with the epsilon ``1e-6 / d`` and weights of
  ``d ** -0.5``: the same quotient), then the rope (its base by the layer's type), then each
  query feature times ``(sqk * sqrt(d) / initializer_range)²`` (``q_scale``); an output gate
  ``sigmoid(x @ W_g * (s_gate * hidden_size ** 0.25 / initializer_range)²)``, whose factors
  the reader folds into ``W_g``; the joined heads' L2 norm (``output_norm="l2"``, epsilon
  ``1e-6``) before ``o_proj``; windows on the ``sliding_attention`` layers.
* Its looped section: the ``n_recurrent_layers`` after the ``n_input_layers`` run
  ``n_recurrent_loops`` times, each loop with caches of its own (``"per_loop"``): the first
  loop's in the layers' own cache slots, loop ``k``'s after the model's layers (transformers'
  ``cache_offset``). ``layer=i`` is cache slot ``i``: layer ``i`` of the model where ``i`` is
  below ``num_hidden_layers``, else a later loop's run of a recurrent layer
  (:func:`~.layouts.loop_slot`), its attention the same and its cache its own. The mode
  ``"last_loop"`` (the earlier loops attend over the last loop's cache without writing to it)
  is refused.

Released configs list an ``"mlp"`` block after each attention block in ``layer_types`` and
count both in ``num_hidden_layers`` and the sections' sizes, which ``DoryConfig`` halves
(:func:`~.layouts.loop_sections`); so does this reader. Released checkpoints keep layer
``i``'s attention as the block ``backbone.layers.{2i}.mixer`` (``g_proj`` its gate), which
transformers loads as ``layers.{i}.self_attn`` and saves under ``backbone.layers.{i}.self_attn``:
either is read (:attr:`~.layouts.Projections.paired`).

>>> [row.name for row in ROWS]
['dory']
>>> from types import SimpleNamespace
>>> from mha.integrations.readers.config import Settings
>>> config = {"num_hidden_layers": 8, "n_input_layers": 2, "n_output_layers": 2,
...           "layer_types": ["sliding_attention", "mlp"] * 3 + ["full_attention", "mlp"]}
>>> read = Settings(SimpleNamespace(path="ckpt", config=config), "dory", DORY)
>>> loop_slots(read), [LOOP_WINDOWS.layer_type(read, slot)[:4] for slot in range(6)]
(6, ['slid', 'slid', 'slid', 'full', 'slid', 'slid'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import AttentionValueError
from .config import FULL, SLIDING, Settings, Unsupported
from .family import Family, Gate, OutputNorm
from .layouts import Projections, Tensor, loop_sections, loop_slot, whole
from .rope import Rope

__all__ = ["DORY", "LOOP_WINDOWS", "ROWS", "LoopWindows", "NgptScales", "loop_slots"]

DORY: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "initializer_range": 0.0177,
    "attention_bias": False,
    "max_position_embeddings": 8192,
    "sliding_window": 1024,
    "layer_types": None,
    "n_input_layers": 8,
    "n_recurrent_layers": None,
    "n_output_layers": 8,
    "n_recurrent_loops": 2,
    "recurrent_kv_cache_mode": "per_loop",
}
"""DoryConfig's defaults (the sections' sizes as its ``__post_init__`` reads them)."""

EPS = 1e-6
"""``DoryL2Norm``'s epsilon (its queries', keys' and joined heads' norms)."""


def _count(read: Settings, key: str, least: int) -> int:
    value = read.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise AttentionValueError(
            f"{read.path}: config.json has {read.name(key)}={value!r}; an integer of at "
            f"least {least} is needed"
        )
    return value


def loop_slots(read: Settings) -> int:
    """The cache slots: the model's layers, then ``n_recurrent_loops - 1`` more runs of each
    recurrent layer; the sections checked as ``DoryConfig.validate_architecture`` checks
    them."""
    for key, least in (("num_hidden_layers", 1), ("n_input_layers", 0), ("n_output_layers", 0)):
        _count(read, key, least)
    loops = _count(read, "n_recurrent_loops", 1)
    if read.get("n_recurrent_layers") is not None:
        _count(read, "n_recurrent_layers", 0)
    layers, first, recurrent, _ = loop_sections({**DORY, **read.config})
    output = _halved(read, "n_output_layers")
    if first + recurrent + output != layers or recurrent < 0:
        raise AttentionValueError(
            f"{read.path}: config.json has {first} input, {recurrent} recurrent and {output} "
            f"output layers (n_input_layers, n_recurrent_layers, n_output_layers) for "
            f"num_hidden_layers={layers}; they must add up to it (DoryConfig checks it)"
        )
    return layers + (loops - 1) * recurrent


def _halved(read: Settings, key: str) -> int:
    """``key``'s count as ``DoryConfig`` reads it (halved with ``"mlp"`` blocks)."""
    types = read.get("layer_types")
    value = int(read.get(key))
    return value // 2 if isinstance(types, list) and "mlp" in types else value


@dataclass(frozen=True)
class LoopWindows:
    """The type of the layer that runs in each cache slot, by ``layer_types`` (its attention
    blocks, where it lists ``"mlp"`` blocks too; else every fourth layer full, the others
    sliding, as ``DoryConfig`` fills it in); ``sliding_window`` on the sliding layers."""

    def layer_type(self, read: Settings, index: int) -> str:
        layers = loop_sections({**DORY, **read.config})[0]
        types = read.get("layer_types")
        if isinstance(types, list) and "mlp" in types:
            types = types[::2]
        if types is None:
            types = [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise AttentionValueError(
                f"{read.path}: config.json's layer_types must list one type for each of its "
                f"{layers} layers (an attention and an mlp block each, as released configs "
                f"do, or the attention blocks alone); got {types!r}"
            )
        kind = types[loop_slot({**DORY, **read.config}, index)]
        if kind not in (SLIDING, FULL):
            raise read.refuse(f"layer type {kind!r} (mha reads {SLIDING} and {FULL})")
        return str(kind)

    def size(self, read: Settings) -> Any:
        return read.get("sliding_window")


LOOP_WINDOWS = LoopWindows()


def _initializer_range(read: Settings) -> float:
    value = read.get("initializer_range")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 < value < float("inf"):
        raise read.refuse(
            f"{read.name('initializer_range')}={value!r} (nGPT's scales are stored divided by "
            "it: a positive number is needed)"
        )
    return float(value)


def unit_queries_and_keys(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Each head's L2 norm of the queries and keys, as the QK-norm of each head: the epsilon
    ``1e-6 / d`` (its weights ``d ** -0.5``: :class:`NgptScales`)."""
    d = settings["head_dim"]
    return {"qk_norm": "head", "qk_norm_eps": EPS / d, "qk_norm_offset": 0.0}


@dataclass(frozen=True)
class NgptScales:
    """nGPT's scales under each attention, ``sqk`` and ``s_gate`` (a factor a query feature
    each), stored as ``s * s_init / initializer_range``: ``q_scale`` is
    ``(sqk * sqrt(d) / initializer_range)²``; ``W_g``'s columns are times
    ``(s_gate * hidden_size ** 0.25 / initializer_range)²``, in float64; the QK-norm's
    weights are ``d ** -0.5`` (its L2 norm)."""

    def tensors(self, read: Settings, settings: dict[str, Any]) -> dict[str, Tensor]:
        width = settings["num_heads"] * settings["head_dim"]
        return {"sqk": whole("sqk", width), "s_gate": whole("s_gate", width)}

    def folded(
        self, read: Settings, settings: dict[str, Any], weights: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        d, E = settings["head_dim"], read.positive("hidden_size")
        init = _initializer_range(read)
        dtype = weights["W_q"].dtype
        sqk, s_gate = weights.pop("sqk"), weights.pop("s_gate")
        q_scale = np.square(sqk.astype(np.float64) * (d**0.5 / init))
        gate = np.square(s_gate.astype(np.float64) * (E**0.25 / init))
        weights["W_g"] = (weights["W_g"].astype(np.float64) * gate).astype(dtype)
        weights["q_scale"] = q_scale.astype(dtype)
        weights["q_norm"] = weights["k_norm"] = np.full(d, d**-0.5, dtype)
        return weights


LAST_LOOP = Unsupported(
    "recurrent_kv_cache_mode",
    "the earlier loops attend over the last loop's cache of each recurrent layer without "
    "writing to it, which no mha cache does; 'per_loop' is read",
    lambda mode: mode != "per_loop",
)

ROWS: tuple[Family, ...] = (
    Family(  # nGPT's attention; the looped section a cache slot a loop
        "dory",
        DORY,
        tensors=Projections(
            path="backbone.layers.{looped}.self_attn", paired="backbone.layers.{block}.mixer"
        ),
        windows=LOOP_WINDOWS,
        rope=Rope(per_layer_type={FULL: (None, 10_000_000.0), SLIDING: (None, 10_000.0)}),
        gate=Gate("g_proj"),
        output_norm=OutputNorm("l2", None, EPS),
        own_weights=NgptScales(),
        slots=loop_slots,
        by_layer=unit_queries_and_keys,
        unsupported=(LAST_LOOP,),
    ),
)
"""The row of this family, registered by :mod:`.registry`."""
