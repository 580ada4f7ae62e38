"""Where a layer's attention keeps its tensors, by transformers' names, and how each becomes
mha's weights (the "x @ W" layout: the transposes of ``nn.Linear``'s ``(out, in)``; GPT-2's
``Conv1D`` holds ``(in, out)``, mha's already), as llama.cpp's ``LLM_TENSOR_NAMES`` names them
per architecture: separate query, key, value and output projections (:data:`SEPARATE_QKV`)
or one fused projection (:data:`FUSED_QKV`), its rows in one of the orders of
:data:`FUSIONS`, their biases (:class:`Biases`, :class:`BiasesByKey`), QK-norms and sinks;
DeepSeek's latent projections (:data:`LATENT`). The module path of layer ``i``'s attention
is the layout's too (``model.layers.{i}.self_attn``, GPT-2's ``transformer.h.{i}.attn``,
EXAONE 3's own ``transformer.h.{i}.attn.attention``: :data:`EXAONE`).

A layout gives each tensor the config calls for as a :class:`Tensor`: its shape, and mha's
weights in it, a fused tensor's row by row, in groups when its rows interleave (BLOOM's
query, key and value of each head in turn).

>>> import numpy as np
>>> tensors = FUSED_QKV.tensors(d_model=4, heads=(2, 1, 2), biased=(), qk_norm=None, sinks=False)
>>> {name: tensor.shape for name, tensor in tensors.items()}
{'o_proj.weight': (4, 4), 'qkv_proj.weight': (8, 4)}
>>> {name: W.shape for name, W in lay_out(np.ones((8, 4)), tensors["qkv_proj.weight"]).items()}
{'W_q': (4, 4), 'W_k': (4, 2), 'W_v': (4, 2)}
>>> per_head = Tensor((6,), (("q", 1), ("k", 1), ("v", 1)), groups=2)  # q0 k0 v0 q1 k1 v1
>>> {name: b.tolist() for name, b in lay_out(np.arange(6.0), per_head).items()}
{'q': [0.0, 3.0], 'k': [1.0, 4.0], 'v': [2.0, 5.0]}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...errors import WeightsFileError
from ..checkpoint import tensor_prefixes
from .config import Settings, Source

__all__ = [
    "ALL_BIASES",
    "ATTENTION_BIAS",
    "EXAONE",
    "FUSED_QKV",
    "FUSIONS",
    "LATENT",
    "NO_BIASES",
    "QKV_ATTENTION_BIAS",
    "QKV_BIASES",
    "QKV_BIASES_BY_KEY",
    "SEPARATE_QKV",
    "Biases",
    "BiasesByKey",
    "LatentProjections",
    "Projections",
    "Tensor",
    "attention_prefix",
    "attentions_per_layer",
    "check_names",
    "lay_out",
    "loop_sections",
    "loop_slot",
    "module_path",
    "outside_layers",
    "stack_heads",
    "stack_slot",
]

IGNORED = ("rotary_emb.inv_freq",)
"""Tensors under a layer's attention that are not read: older checkpoints' rotary buffer,
which the config gives."""


@dataclass(frozen=True)
class Tensor:
    """One tensor under a layer's attention: its shape, and mha's weights it holds, each with
    its rows (output features) in each of ``groups`` equal blocks of rows, in order (one
    block: the weights one after the other). ``transposed``: a matrix stored ``(in, out)``,
    as ``Conv1D`` keeps it, whose rows are its columns."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, int], ...]
    groups: int = 1
    transposed: bool = False


def whole(name: str, *shape: int, transposed: bool = False) -> Tensor:
    """A tensor that is one weight of mha's."""
    return Tensor(shape[::-1] if transposed else shape, ((name, shape[0]),), transposed=transposed)


def lay_out(array: np.ndarray, tensor: Tensor) -> dict[str, np.ndarray]:
    """mha's weights from one tensor: matrices as "x @ W", a fused tensor split."""
    W = array.T if array.ndim == 2 and not tensor.transposed else array
    if len(tensor.parts) == 1:
        return {tensor.parts[0][0]: W}
    G = tensor.groups
    blocks = W.reshape(*W.shape[:-1], G, W.shape[-1] // G)
    weights, start = {}, 0
    for name, rows in tensor.parts:
        weights[name] = blocks[..., start : start + rows].reshape(*W.shape[:-1], G * rows)
        start += rows
    return weights


@dataclass(frozen=True)
class Biases:
    """Which projections carry a bias: those in ``roles`` (every one that can, when
    ``None``), always or, with ``key``, when that config key is true; those in ``last`` only
    in the last layer (GPT-NeoX-Japanese's output bias); those in ``always`` whatever ``key``
    says (RecurrentGemma's output bias)."""

    key: str | None = None
    roles: tuple[str, ...] | None = None
    last: tuple[str, ...] = ()
    always: tuple[str, ...] = ()

    def carried(
        self, read: Settings, possible: Iterable[str], index: int | None = None
    ) -> tuple[str, ...]:
        """The roles biased in layer ``index`` (``None``: any layer)."""
        if self.key is not None and not read.get(self.key):
            return tuple(role for role in possible if role in self.always)
        roles = [role for role in possible if self.roles is None or role in self.roles]
        if self.last and index is not None and index != read.positive("num_hidden_layers") - 1:
            roles = [role for role in roles if role not in self.last]
        return tuple(roles)


@dataclass(frozen=True)
class BiasesByKey:
    """Each projection in ``keys`` biased when its own config key is true (Seed-OSS:
    ``attention_bias`` for the query, key and value, ``attention_out_bias`` for the output)."""

    keys: Mapping[str, str]

    def carried(
        self, read: Settings, possible: Iterable[str], index: int | None = None
    ) -> tuple[str, ...]:
        """The roles biased (in any layer: ``index`` is not read)."""
        return tuple(role for role in possible if role in self.keys and read.get(self.keys[role]))


ATTENTION_BIAS = Biases("attention_bias")
"""All four projections biased or none, as ``attention_bias`` says (Llama's)."""
QKV_BIASES = Biases(roles=("q", "k", "v"))
"""The query, key and value projections always biased, the output never (Qwen2's)."""
QKV_BIASES_BY_KEY = Biases("attention_bias", roles=("q", "k", "v"))
"""The query, key and value projections biased as ``attention_bias`` says, the output never
(Helium's, Solar Open's)."""
NO_BIASES = Biases(roles=())
QKV_ATTENTION_BIAS = Biases("attention_bias", roles=("q", "k", "v"))
"""The query, key and value projections biased as ``attention_bias`` says, the output never
(GLM's, Helium's)."""
ALL_BIASES = Biases()
"""All four projections always biased (Phi's)."""


FUSIONS: dict[str, Callable[[int, int], int]] = {
    "contiguous": lambda H, H_kv: 1,
    "per_kv_head": lambda H, H_kv: H_kv,
    "four_blocks": lambda H, H_kv: 4,
}
"""How many blocks a fused projection's rows come in, from the heads ``(H, H_kv)``: each
block holds its share of the queries, keys and values in turn. One (Phi-3, GPT-2, MPT);
one per key/value head (BLOOM and GPT-NeoX, a head's query, key and value; Falcon's new
architecture, a group's queries, then its key and value; with one key/value head, the
contiguous layout of multi-query BigCode and Falcon); four (CodeGen's ``mp_num``)."""


def _norm_tensors(
    weight: str, name: str, part: str, kind: str, d: int, heads: int
) -> dict[str, Tensor]:
    """The tensors of one QK-norm weight (or bias) ``weight`` of ``heads`` heads ``d`` wide:
    one vector (``"head"``, ``"all"``), one ``(heads, d)`` matrix (Cohere's ``"each_head"``),
    or, where ``name`` has ``{h}``, one vector a head (StableLM's ``norms.{h}``), each laid
    out as row ``h`` of ``weight`` (:func:`stack_heads`)."""
    if kind != "each_head":
        return {f"{name}.{part}": whole(weight, d if kind == "head" else heads * d)}
    if "{h}" not in name:
        return {f"{name}.{part}": whole(weight, d, heads, transposed=True)}
    return {f"{name.format(h=h)}.{part}": whole(f"{weight}[{h}]", d) for h in range(heads)}


def stack_heads(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with the rows ``name[h]`` of one weight a head stacked as ``name``."""
    rows: dict[str, dict[int, np.ndarray]] = {}
    for key in [key for key in weights if key.endswith("]")]:
        name, _, h = key[:-1].partition("[")
        rows.setdefault(name, {})[int(h)] = weights.pop(key)
    for name, by_head in rows.items():
        weights[name] = np.stack([by_head[h] for h in sorted(by_head)])
    return weights


@dataclass(frozen=True)
class Projections:
    """transformers' names of a multi-head attention's modules: the query, key, value and
    output projections (or ``qkv``, one fused projection whose rows come in blocks as
    ``fusion`` says, each the queries, keys and values in ``order``), the QK-norms and the
    sinks; ``conv1d`` when the matrices are GPT-2's ``Conv1D`` (stored ``(in, out)``);
    ``path``, the module of layer ``{i}``'s attention; ``o_bias``, the output bias's name
    when it is not the output projection's ``bias``."""

    kind: ClassVar[str] = "attention"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    o_bias: str | None = None
    fusion: str = "contiguous"
    order: str = "qkv"
    conv1d: bool = False
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    sinks: str = "sinks"
    path: str = "model.layers.{i}.self_attn"
    paired: str | None = None
    """Where a checkpoint that keeps each decoder layer as two blocks, attention then mlp,
    has layer ``{i}``'s attention (``{block}``: ``2i``; Dory's released checkpoints,
    ``backbone.layers.{block}.mixer``, which transformers' ``LayerPairCollapse`` loads as
    its ``layers.{i}.self_attn``), tried after :attr:`path`."""

    def tensors(
        self,
        d_model: int,
        heads: tuple[int, int, int],
        biased: Iterable[str],
        qk_norm: str | None,
        sinks: bool,
        norm_biases: bool = False,
        v_head_dim: int | None = None,
    ) -> dict[str, Tensor]:
        """The tensors of a layer of ``heads`` (query heads, key/value heads, head width):
        projections with the ``biased`` ones' biases, the QK-norm's weights (per ``"head"``,
        across ``"all"`` heads, or ``"each_head"``'s own; with ``norm_biases``, a LayerNorm's
        biases too) and the sinks; the values ``v_head_dim`` wide a head where given."""
        H, H_kv, d = heads
        d_v = d if v_head_dim is None else v_head_dim
        q, kv, E = H * d, H_kv * d, d_model
        widths = {"q": q, "k": kv, "v": H_kv * d_v, "o": E}
        tensors = {f"{self.o}.weight": whole("W_o", E, H * d_v, transposed=self.conv1d)}
        if self.qkv is not None:
            G = FUSIONS[self.fusion](H, H_kv)
            parts = tuple((f"W_{p}", widths[p] // G) for p in self.order)
            rows = q + kv + widths["v"]
            tensors[f"{self.qkv}.weight"] = Tensor(
                (E, rows) if self.conv1d else (rows, E), parts, G, self.conv1d
            )
        else:
            names = {"q": self.q, "k": self.k, "v": self.v}
            tensors |= {f"{names[p]}.weight": whole(f"W_{p}", widths[p], E) for p in "qkv"}
        tensors |= self._biases(tuple(biased), widths, H, H_kv)
        if qk_norm is not None:
            roles = (("weight", ""), ("bias", "_bias")) if norm_biases else (("weight", ""),)
            for role, name, count in (("q", self.q_norm, H), ("k", self.k_norm, H_kv)):
                for part, suffix in roles:
                    tensors |= _norm_tensors(f"{role}_norm{suffix}", name, part, qk_norm, d, count)
        if sinks:
            tensors[self.sinks] = whole("sinks", H)
        return tensors

    def _biases(
        self, biased: tuple[str, ...], widths: dict[str, int], H: int, H_kv: int
    ) -> dict[str, Tensor]:
        o_bias = self.o_bias or f"{self.o}.bias"
        if self.qkv is None:
            names = {"q": f"{self.q}.bias", "k": f"{self.k}.bias", "v": f"{self.v}.bias",
                     "o": o_bias}  # fmt: skip
            return {names[p]: whole(f"b_{p}", widths[p]) for p in biased}
        tensors = {}
        if any(p in biased for p in "qkv"):  # one bias for the fused projection
            G = FUSIONS[self.fusion](H, H_kv)
            parts = tuple((f"b_{p}", widths[p] // G) for p in self.order)
            rows = widths["q"] + widths["k"] + widths["v"]
            tensors[f"{self.qkv}.bias"] = Tensor((rows,), parts, G)
        if "o" in biased:
            tensors[o_bias] = whole("b_o", widths["o"])
        return tensors

    def grouped(self, heads: tuple[int, int, int]) -> bool:
        """Whether the fused rows divide into the layout's blocks for ``heads``."""
        H, H_kv, d = heads
        G = FUSIONS[self.fusion](H, H_kv) if self.qkv is not None else 1
        return H * d % G == 0 and H_kv * d % G == 0


SEPARATE_QKV = Projections()
"""``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (Llama's and most families')."""
FUSED_QKV = Projections(qkv="qkv_proj")
"""One ``qkv_proj`` and ``o_proj`` (Phi-3's)."""
GPT2_LAYOUT = Projections(o="c_proj", qkv="c_attn", conv1d=True, path="transformer.h.{i}.attn")
"""GPT-2's ``Conv1D`` ``c_attn`` (queries, keys, values) and ``c_proj``; GPT-1's too."""
BIGCODE = Projections(o="c_proj", qkv="c_attn", fusion="per_kv_head", path="transformer.h.{i}.attn")
"""BigCode's ``c_attn``: one key/value head (multi-query) after the queries, or each head's
query, key and value in turn."""
GPT_NEOX = Projections(
    o="dense", qkv="query_key_value", fusion="per_kv_head", path="gpt_neox.layers.{i}.attention"
)
GPT_NEOX_JAPANESE = Projections(
    o="dense",
    o_bias="dense_bias",
    qkv="query_key_value",
    fusion="per_kv_head",
    path="gpt_neox_japanese.layers.{i}.attention",
)
BLOOM = Projections(
    o="dense", qkv="query_key_value", fusion="per_kv_head", path="transformer.h.{i}.self_attention"
)
FALCON = BLOOM
"""Falcon's ``query_key_value`` in blocks of one key/value head each, as BLOOM's."""
GPTJ = Projections(o="out_proj", path="transformer.h.{i}.attn")
CODEGEN = Projections(
    o="out_proj", qkv="qkv_proj", fusion="four_blocks", order="qvk", path="transformer.h.{i}.attn"
)
GPT_NEO = Projections(o="out_proj", path="transformer.h.{i}.attn.attention")
MPT = Projections(o="out_proj", qkv="Wqkv", path="transformer.blocks.{i}.attn")
PERSIMMON = Projections(
    o="dense",
    qkv="query_key_value",
    fusion="per_kv_head",
    q_norm="q_layernorm",
    k_norm="k_layernorm",
)
DBRX = Projections(o="out_proj", qkv="Wqkv", path="transformer.blocks.{i}.norm_attn_norm.attn")
OPT = Projections(o="out_proj", path="model.decoder.layers.{i}.self_attn")
BIOGPT = Projections(o="out_proj", path="biogpt.layers.{i}.self_attn")
XGLM = Projections(o="out_proj")
CTRL = Projections(q="Wq", k="Wk", v="Wv", o="dense", path="transformer.h.{i}.multi_head_attention")
EXAONE = Projections(o="out_proj", path="transformer.h.{i}.attn.attention")
"""EXAONE 3's own names, which transformers renames to Llama's when it loads them and back
when it saves."""
MODERNBERT_DECODER = Projections(o="Wo", path="model.layers.{i}.attn")
SARVAM_MOE = Projections(
    o="dense",
    qkv="query_key_value",
    q_norm="query_layernorm",
    k_norm="key_layernorm",
    path="model.layers.{i}.attention",
)
"""Sarvam-MoE's own names, which transformers renames to GLM-4.5's (``q_proj``, ``k_proj``,
``v_proj`` split from the fused rows) when it loads them and back when it saves."""


@dataclass(frozen=True)
class LatentProjections:
    """transformers' names of DeepSeek's multi-head latent attention modules."""

    kind: ClassVar[str] = "latent"
    q: str = "q_proj"
    q_a: str = "q_a_proj"
    q_a_norm: str = "q_a_layernorm"
    q_b: str = "q_b_proj"
    kv_a: str = "kv_a_proj_with_mqa"
    kv_a_norm: str = "kv_a_layernorm"
    kv_b: str = "kv_b_proj"
    o: str = "o_proj"
    path: str = "model.layers.{i}.self_attn"
    lora_scaled: bool = False
    """Whether the query is multiplied by ``sqrt(hidden_size / q_lora_rank)`` and the
    normalised latent by ``sqrt(hidden_size / kv_lora_rank)`` (LongCat-Flash's), read into
    the weights of the two norms."""
    query_gate: bool = False
    """Whether ``q_b`` fuses the query's projection with a gate per feature, both reading
    the query latent after and before its norm (A.X-K2's ``q_gate_proj``, saved as
    ``q_b_proj``: each head's query rows then its gate's)."""

    def tensors(self, settings: Mapping[str, Any], biased: Iterable[str]) -> dict[str, Tensor]:
        """The tensors of a latent layer of these ``settings`` (:class:`mha.LatentSpec`'s
        keywords), with the ``biased`` projections' biases (``q_a``, ``kv_a``, ``o``)."""
        E, H, q_rank = settings["d_model"], settings["num_heads"], settings["q_lora_rank"]
        rank, v = settings["kv_lora_rank"], settings["v_head_dim"]
        nope, rope = settings["qk_nope_head_dim"], settings["qk_rope_head_dim"]
        head = H * (nope + rope)
        tensors = {
            f"{self.kv_a}.weight": whole("W_kv_a", rank + rope, E),
            f"{self.kv_a_norm}.weight": whole("kv_a_norm", rank),
            f"{self.kv_b}.weight": whole("W_kv_b", H * (nope + v), rank),
            f"{self.o}.weight": whole("W_o", E, H * v),
        }
        if q_rank is None:
            tensors[f"{self.q}.weight"] = whole("W_q", head, E)
        else:
            tensors[f"{self.q_a}.weight"] = whole("W_q_a", q_rank, E)
            tensors[f"{self.q_a_norm}.weight"] = whole("q_a_norm", q_rank)
            tensors[f"{self.q_b}.weight"] = whole("W_q_b", head, q_rank)
        if q_rank is not None and self.query_gate:
            parts = (("W_q_b", nope + rope), ("W_g", v))
            tensors[f"{self.q_b}.weight"] = Tensor((H * (nope + rope + v), 2 * q_rank), parts, H)
        widths = {"kv_a": rank + rope, "o": E, "q_a": q_rank}
        names = {"kv_a": self.kv_a, "o": self.o, "q_a": self.q_a}
        tensors |= {f"{names[p]}.bias": whole(f"b_{p}", widths[p]) for p in biased}
        return tensors

    def biasable(self, settings: Mapping[str, Any]) -> tuple[str, ...]:
        """The projections that may carry a bias: ``q_a`` (when there is one), ``kv_a``, ``o``."""
        return ("kv_a", "o") + (() if settings["q_lora_rank"] is None else ("q_a",))

    def layer(self, read: Settings, index: int) -> Settings:
        """Layer ``index``'s config: ``read`` itself (every layer alike, here)."""
        return read

    def settings(self, read: Settings, index: int) -> dict[str, Any]:
        """Settings of layer ``index`` beside DeepSeek's (none, here)."""
        return {}

    def indexer(self, read: Settings, index: int) -> Any:
        """Layer ``index``'s sparse top-k indexer (:class:`mha.api.sparse.IndexerSpec`), or
        ``None`` for dense attention (every row here; :mod:`.sparse`'s rows have one)."""
        return None

    def choice_from(self, read: Settings, index: int) -> int | None:
        """The earlier layer whose indexer's choice of keys layer ``index`` attends with
        (``shares_choice_with``: HY-V4's ``"shared"`` layers), or ``None``."""
        return None


LATENT = LatentProjections()
"""DeepSeek V2's and V3's modules."""
LONGCAT_FLASH = LatentProjections(path="model.layers.{i}.self_attn.{j}", lora_scaled=True)
"""LongCat-Flash's: two latent attentions in each decoder layer."""


def module_path(path: str, index: int, config: Mapping[str, Any] | None = None) -> str:
    """The module of layer ``index``'s attention under ``path``: decoder layer ``{i}``'s, or,
    where the path names ``{j}``, attention ``j`` of the two each decoder layer holds
    (LongCat-Flash's ``self_attn.0`` and ``.1``), layer ``2i + j`` as transformers numbers
    them; where it names ``{stack}``, the layer that cache slot ``index`` runs in recurrent
    stacks (:func:`stack_slot`, of ``config``); where it names ``{looped}``, the decoder
    layer that cache slot ``index`` runs in a looped section (:func:`loop_slot`), or its
    attention block ``{block}`` in a checkpoint of two blocks a layer (twice its index)."""
    if "{looped}" in path or "{block}" in path:
        layer = loop_slot(config or {}, index)
        return path.format(looped=layer, block=2 * layer)
    if "{stack}" in path:
        stack, layer = stack_slot(config or {}, index)
        return path.format(stack=stack, i=layer)
    if "{j}" in path:
        return path.format(i=index // 2, j=index % 2)
    return path.format(i=index)


def stack_slot(config: Mapping[str, Any], index: int) -> tuple[str, int]:
    """HRM's recurrent stacks: each of ``H_cycles`` cycles runs the L stack ``L_cycles`` times,
    then the H stack once, each run of each of its ``num_layers_per_stack`` layers with a
    cache slot of its own, numbered in that order. Slot ``index``'s stack (``"L"`` or
    ``"H"``) and layer in it. ``config.json`` omits the config class's defaults (3 L cycles);
    an older one without ``num_layers_per_stack`` counts a stack's layers in
    ``num_hidden_layers`` (its row refuses it).

    >>> [stack_slot({"num_layers_per_stack": 2, "L_cycles": 1}, s) for s in range(5)]
    [('L', 0), ('L', 1), ('H', 0), ('H', 1), ('L', 0)]
    """
    per_stack = int(config.get("num_layers_per_stack") or config.get("num_hidden_layers") or 1)
    runs = int(config.get("L_cycles", 3)) + 1
    run, layer = divmod(index, per_stack)
    return ("H" if run % runs == runs - 1 else "L"), layer


def loop_sections(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """Dory's layers as its config class reads ``config.json`` (its defaults where it has
    none): ``(layers, input layers, recurrent layers, loops)``. A ``layer_types`` that lists
    an ``"mlp"`` block after each attention block (as released configs and ``to_dict``
    write it) counts every layer twice: each count is halved, as ``DoryConfig`` does."""
    layers, first = config.get("num_hidden_layers", 36), config.get("n_input_layers", 8)
    last, recurrent = config.get("n_output_layers", 8), config.get("n_recurrent_layers")
    types = config.get("layer_types")
    if isinstance(types, list) and "mlp" in types:
        layers, first, last = layers // 2, first // 2, last // 2
        recurrent = None if recurrent is None else recurrent // 2
    if recurrent is None:
        recurrent = layers - first - last
    return layers, first, recurrent, config.get("n_recurrent_loops", 2)


def loop_slot(config: Mapping[str, Any], index: int) -> int:
    """Dory's looped section: the ``n_recurrent_layers`` after its ``n_input_layers`` run
    ``n_recurrent_loops`` times, the first run in the layers' own cache slots, each later
    loop's in a copy of them after the model's layers (transformers' ``cache_offset``).
    The decoder layer whose attention runs in cache slot ``index``.

    >>> config = {"num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1}
    >>> [loop_slot(config, s) for s in range(6)]
    [0, 1, 2, 3, 1, 2]
    """
    layers, first, recurrent, _ = loop_sections(config)
    return index if index < layers else first + (index - layers) % recurrent


def attentions_per_layer(path: str) -> int:
    """How many attention layers each decoder layer holds (:func:`module_path`)."""
    return 2 if "{j}" in path else 1


def attention_prefix(
    source: Source, index: int, path: str = SEPARATE_QKV.path, paired: str | None = None
) -> str:
    """Where layer ``index``'s attention tensors are: at the layout's ``path`` (a causal
    LM's checkpoint: ``model.layers.{i}.self_attn``), or below its first name (a bare
    model's: ``layers.{i}.self_attn``), else at its ``paired`` path, where it has one
    (:attr:`Projections.paired`)."""
    candidates: tuple[str, ...] = ()
    for each in (path,) if paired is None else (path, paired):
        full = module_path(each, index, source.config) + "."
        candidates += (full, full.split(".", 1)[1])
    keys = list(source)
    for prefix in candidates:
        if any(key.startswith(prefix) for key in keys):
            return prefix
    raise WeightsFileError(
        f"{source.path} has no attention weights of layer {index} under "
        f"{' or '.join(candidates)}; it holds {len(keys)} tensors under {tensor_prefixes(keys)}"
    )


def outside_layers(prefix: str, path: str, name: str) -> str:
    """The checkpoint's name of a tensor outside the layers, given under a causal LM's full
    names (``cpmant.position_bias...``): as it is, or without its first name where the
    layers' ``prefix`` lacks the first name of their ``path`` (a bare model's checkpoint)."""
    return name if prefix.startswith(path.split(".", 1)[0] + ".") else name.split(".", 1)[1]


def check_names(source: Source, prefix: str, names: Iterable[str], read: Settings) -> None:
    """Every tensor under ``prefix`` is one of ``names`` (those the config calls for, named
    under ``prefix``), and all of those are there."""
    present = {key[len(prefix) :] for key in source if key.startswith(prefix)}
    unknown = sorted(present - set(names) - set(IGNORED))
    if unknown:
        raise WeightsFileError(
            f"{source.path}: the attention at {prefix!r} has weights that "
            f"{read.family}'s attention with this config ({read.summary()}) does not "
            f"have: {', '.join(unknown)}; loading it without them would compute another model"
        )
    missing = sorted(set(names) - present)
    if missing:
        raise WeightsFileError(
            f"{source.path}: the attention at {prefix!r} lacks {', '.join(missing)}, "
            f"which {read.family}'s attention with this config ({read.summary()}) has"
        )
