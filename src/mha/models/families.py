"""What each family's decoder computes around its attention, one row of :data:`FAMILIES` per
``model_type``, written from its ``modeling_<family>.py`` in transformers 5.24: where its
tensors lie (:class:`Top`), its norms and where they sit, how the residual stream adds the
attention and the MLP, the MLP, and the scales from the config (:class:`Scales`). The
attention of each layer is mha's (``from_pretrained(path, layer=i)``), whatever the row says.

The shapes of layer the rows describe (``residual``):

* ``"sequential"`` (Llama and most since): ``x + after(attention(before(x)))``, then the same
  with the MLP and its two norms (either may be absent: OLMo 2 has only the ones after);
* ``"parallel"`` (GPT-J, GPT-NeoX, Phi, Falcon, Cohere): ``x + attention(a) + mlp(m)``, with
  ``a`` the input's first norm and ``m`` its third, or ``a`` again where there is no third;
* ``"post"`` (GPT-1, OPT-350m): ``x = norm(x + attention(x))``, then
  ``x = norm(x + mlp(x))``: the norms after the sums;
* ``"altup"`` (Gemma 3n): Gemma 2's sandwich on the active one of several residual streams,
  with AltUp's predictions and corrections of them and LAuReL beside the attention
  (:mod:`.gemma`).

>>> FAMILIES["gpt2"].residual, FAMILIES["gpt_neox"].top.layers
('sequential', 'gpt_neox.layers')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .layers import GATE_UP_DOWN, UnsupportedModelError

__all__ = ["FAMILIES", "NOT_WRITTEN", "Family", "HeadStage", "Positions", "Scales", "Stages", "Top"]

Config = Callable[..., Any]
"""A config's values as its class reads them: ``get(key, default)`` (the readers' Settings)."""

PRE = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
POST = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
GPT2_NORMS = ("ln_1", None, "ln_2", None)
SHARED = ("input_layernorm", None, None, None)  # one norm read by the attention and the MLP


@dataclass(frozen=True)
class Positions:
    """Absolute positions added to the embeddings: ``learned`` (a table ``name``, row
    ``position + offset``: OPT's and BioGPT's start at 2), or computed: ``sinusoidal``
    (XGLM's, fairseq's: the sines of all the frequencies, then their cosines; row
    ``position + offset``, the row the config's ``padding_key`` gives all zeros) or
    ``ctrl`` (CTRL's: the sines of the even features' angles, then the cosines of the odd
    ones')."""

    kind: str  # "learned", "sinusoidal" or "ctrl"
    name: str = ""
    offset: int = 0
    padding_key: str | None = None


@dataclass(frozen=True)
class Top:
    """Where the model's own tensors lie: its layers (``{layers}.{i}.``), the token
    embeddings, the positions, a norm of the embeddings (BLOOM's), the final norm (none in
    GPT-1), the head (``None``: the embeddings, tied) and a stage before it (ModernBERT's)."""

    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    norm: str | None = "model.norm"
    head: str | None = "lm_head"
    positions: Positions | None = None
    embed_norm: str | None = None
    before_head: HeadStage | None = None


def _constant(key: str, default: float | None = None) -> Callable[[Config], float | None]:
    return lambda get: get(key, default)


def _divided_by(key: str) -> Callable[[Config], float]:
    return lambda get: 1.0 / float(get(key, 1.0))


def _sqrt_hidden(get: Config) -> float:
    return math.sqrt(float(get("hidden_size")))


@dataclass(frozen=True)
class Scales:
    """The config's multipliers: of the embeddings, of each sublayer's output before it is
    added to the residual stream, of the logits (``None``: 1)."""

    embed: Callable[[Config], float | None] = lambda get: None
    residual: Callable[[Config], float | None] = lambda get: None
    logits: Callable[[Config], float | None] = lambda get: None


@dataclass(frozen=True)
class Stages:
    """Gemma 3n's and Gemma 4's stages beyond the sandwich of norms (:mod:`.gemma`): per-layer
    inputs where the config's ``hidden_size_per_layer_input`` (default 256) is set
    (``clamp``: ids outside their table read its row 0), each layer's ``layer_scalar``, and
    AltUp with LAuReL (``residual="altup"``)."""

    per_layer: bool = True
    clamp: bool = False
    scalar: bool = False


@dataclass(frozen=True)
class Family:
    """What a family's decoder layer does around its attention."""

    norms: tuple[str | None, ...]
    """The layer's norms before attention, after it, before the MLP and after it."""
    norm: str = "llama"  # the kind of every norm: a key of layers.NORMS
    eps_key: str = "rms_norm_eps"
    residual: str = "sequential"  # or "parallel", "post", "altup" (Gemma 3n's streams)
    mlp: str = "gated"  # or "plain", "fused" (Phi-3), "glu", "gpt_oss", "deepseek", "experts"
    mlp_names: tuple[str, ...] = tuple(f"mlp.{name}" for name in GATE_UP_DOWN)
    """The MLP's projections: gate, up and down (``"gated"``), up and down (``"plain"``),
    gate and up in one then down (``"glu"``: ModernBERT's ``Wi`` and ``Wo``)."""
    conv1d: bool = False  # GPT-2's Conv1D projections: weights stored (in, out)
    activation_key: str = "hidden_act"
    activation: str | None = None  # the family's own, whatever the config says (BLOOM's)
    act_fn: str = "mlp.act_fn."  # where an activation with weights of its own has them (xIELU)
    experts: tuple[str, tuple[str, ...]] = ("mlp.", GATE_UP_DOWN)
    """Where a mixture's router (``gate``) and experts lie, and each expert's projections."""
    normalise: bool = False  # the top experts' weights renormalised whatever the config says
    first_norms: tuple[str | None, ...] | None = None  # the first layer's, where they differ
    top: Top = Top()
    scales: Scales = Scales()
    adapt: Callable[[Family, Config], Family] | None = None
    """The row for a config whose layer differs (OPT's ``do_layer_norm_before``...), or a
    refusal naming the setting."""

    eps: float | None = None  # where the config has no eps_key (OPT's norms: 1e-5)
    stages: Stages | None = None  # Gemma 3n's and Gemma 4's

    def for_config(self, get: Config) -> Family:
        return self if self.adapt is None else self.adapt(self, get)


def _refuse(get: Config, key: str, unless: Any, what: str) -> None:
    if get(key, unless) != unless:
        raise UnsupportedModelError(f"mha.models does not compute {what} ({key}={get(key)!r})")


# ---------------------------------------------------------------- adaptations by config


def _gpt_neox(family: Family, get: Config) -> Family:
    """GPT-NeoX's ``use_parallel_residual``: its two norms both on the input, or in turn."""
    if get("use_parallel_residual", True):
        return family
    return dataclasses.replace(family, residual="sequential")


def _stablelm(family: Family, get: Config) -> Family:
    """StableLM's ``use_parallel_residual``: one norm read by both, or Llama's layer."""
    if not get("use_parallel_residual", False):
        return family
    return dataclasses.replace(family, norms=SHARED, residual="parallel")


def _opt(family: Family, get: Config) -> Family:
    _refuse(
        get,
        "word_embed_proj_dim",
        get("hidden_size"),
        "OPT's projections in and out of the embeddings",
    )
    _refuse(get, "layer_norm_elementwise_affine", True, "OPT's norms without weights")
    if get("do_layer_norm_before", True):
        return family
    top = dataclasses.replace(family.top, norm=None)
    norms = (None, "self_attn_layer_norm", None, "final_layer_norm")
    return dataclasses.replace(family, norms=norms, residual="post", top=top)


def _falcon(family: Family, get: Config) -> Family:
    """Falcon's three layers: parallel with one norm (7B), with two (``ln_attn``, ``ln_mlp``:
    40B's new decoder architecture), or sequential."""
    if get("new_decoder_architecture"):
        if get("num_ln_in_parallel_attn") in (None, 2):
            return dataclasses.replace(family, norms=("ln_attn", None, "ln_mlp", None))
        return family
    if get("parallel_attn", True):
        return family
    norms = ("input_layernorm", None, "post_attention_layernorm", None)
    return dataclasses.replace(family, norms=norms, residual="sequential")


def _bloom(family: Family, get: Config) -> Family:
    _refuse(
        get, "apply_residual_connection_post_layernorm", False, "BLOOM's residual after the norm"
    )
    return family


def _hyperclovax(family: Family, get: Config) -> Family:
    """HyperCLOVA X's ``use_post_norm``: RMSNorms after the attention and the MLP too."""
    if not get("use_post_norm", True):
        return family
    norms = ("input_layernorm", "post_norm1", "post_attention_layernorm", "post_norm2")
    return dataclasses.replace(family, norms=norms)


def _minicpm3_residual(get: Config) -> float:
    """MiniCPM3's branches scaled by ``scale_depth / sqrt(num_hidden_layers)``."""
    return float(get("scale_depth", 1.4)) / math.sqrt(float(get("num_hidden_layers")))


def _minicpm3_logits(get: Config) -> float:
    """MiniCPM3's logits divided by ``hidden_size / dim_model_base``."""
    base = get("dim_model_base", 256) or get("hidden_size")
    return float(base) / float(get("hidden_size"))


# ---------------------------------------------------------------- the families

LLAMA = Family(PRE)
GEMMA = Family(
    SANDWICH, "gemma", activation_key="hidden_activation", scales=Scales(embed=_sqrt_hidden)
)
MIXTRAL = Family(
    PRE, mlp="experts", experts=("block_sparse_moe.", ("w1", "w3", "w2")), normalise=True
)
GPT2 = Family(
    GPT2_NORMS,
    "layer",
    "layer_norm_epsilon",
    mlp="plain",
    mlp_names=("mlp.c_fc", "mlp.c_proj"),
    conv1d=True,
    activation_key="activation_function",
    top=Top(
        "transformer.h",
        "transformer.wte",
        "transformer.ln_f",
        "lm_head",  # tied in GPT-2's checkpoints; a GGUF file holds a copy
        Positions("learned", "transformer.wpe"),
    ),
)
PARALLEL_GPTJ = Family(
    ("ln_1", None, None, None),
    "layer",
    "layer_norm_epsilon",
    "parallel",
    "plain",
    ("mlp.fc_in", "mlp.fc_out"),
    activation_key="activation_function",
    top=Top("transformer.h", "transformer.wte", "transformer.ln_f"),
)
COHERE = Family(
    SHARED,
    "float32_layer",
    "layer_norm_eps",
    "parallel",
    scales=Scales(logits=_constant("logit_scale", 0.0625)),
)
FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "phi3": Family(PRE, mlp="fused"),
    "olmo2": Family(POST, "olmo2"),
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "gpt_oss": Family(PRE, "olmo2", mlp="gpt_oss"),
    "deepseek_v3": Family(PRE, mlp="deepseek"),
    # families whose attention is one of the above's under other names (docs/pretrained.md)
    "smollm3": LLAMA,
    "helium": LLAMA,
    "seed_oss": LLAMA,
    "cwm": LLAMA,
    "internlm3": LLAMA,
    "gemma": Family(PRE, "gemma", scales=Scales(embed=_sqrt_hidden)),
    "olmo3": Family(POST, "olmo2"),
    "exaone4": Family(POST),
    "mixtral": MIXTRAL,
    "qwen3_moe": Family(PRE, mlp="experts"),
    "olmoe": Family(PRE, mlp="experts"),
    # GPT-2 and the older families: LayerNorms, plain MLPs, learned positions
    "gpt2": GPT2,
    "gpt-sw3": GPT2,
    "gpt_bigcode": dataclasses.replace(GPT2, conv1d=False),
    "gpt_neo": dataclasses.replace(GPT2, conv1d=False),
    "openai-gpt": dataclasses.replace(
        GPT2,
        norms=(None, "ln_1", None, "ln_2"),
        residual="post",
        activation_key="afn",
        top=Top(
            "transformer.h",
            "transformer.tokens_embed",
            None,
            None,
            Positions("learned", "transformer.positions_embed"),
        ),
    ),
    "opt": Family(
        ("self_attn_layer_norm", None, "final_layer_norm", None),
        "layer",
        "layer_norm_eps",
        eps=1e-5,
        mlp="plain",
        mlp_names=("fc1", "fc2"),
        activation_key="activation_function",
        top=Top(
            "model.decoder.layers",
            "model.decoder.embed_tokens",
            "model.decoder.final_layer_norm",
            None,
            Positions("learned", "model.decoder.embed_positions", offset=2),
        ),
        adapt=_opt,
    ),
    "gptj": PARALLEL_GPTJ,
    "codegen": PARALLEL_GPTJ,
    "phi": Family(
        SHARED,
        "layer",
        "layer_norm_eps",
        "parallel",
        "plain",
        ("mlp.fc1", "mlp.fc2"),
        top=Top(norm="model.final_layernorm"),
    ),
    "gpt_neox": Family(
        PRE,
        "layer",
        "layer_norm_eps",
        "parallel",
        "plain",
        ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        top=Top("gpt_neox.layers", "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out"),
        adapt=_gpt_neox,
    ),
    "falcon": Family(
        SHARED,
        "layer",
        "layer_norm_epsilon",
        "parallel",
        "plain",
        ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        activation_key="activation",
        top=Top("transformer.h", "transformer.word_embeddings", "transformer.ln_f"),
        adapt=_falcon,
    ),
    "bloom": Family(
        PRE,
        "layer",
        "layer_norm_epsilon",
        mlp="plain",
        mlp_names=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        activation="bloom_gelu",
        top=Top(
            "transformer.h",
            "transformer.word_embeddings",
            "transformer.ln_f",
            None,
            embed_norm="transformer.word_embeddings_layernorm",
        ),
        adapt=_bloom,
    ),
    "starcoder2": Family(
        PRE, "layer", "norm_epsilon", mlp="plain", mlp_names=("mlp.c_fc", "mlp.c_proj")
    ),
    "stablelm": Family(PRE, "layer", "layer_norm_eps", adapt=_stablelm),
    "persimmon": Family(
        PRE,
        "layer",
        "layer_norm_eps",
        mlp="plain",
        mlp_names=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        top=Top(norm="model.final_layernorm"),
    ),
    "arcee": Family(PRE, mlp="plain", mlp_names=("mlp.up_proj", "mlp.down_proj")),
    "jais2": Family(
        PRE, "layer", "layer_norm_eps", mlp="plain", mlp_names=("mlp.up_proj", "mlp.down_proj")
    ),
    "ernie4_5": LLAMA,
    "iquestcoder": LLAMA,
    "hunyuan_v1_dense": LLAMA,
    "ministral": LLAMA,
    "ministral3": LLAMA,
    "youtu": LLAMA,
    "glm": Family(PRE, mlp="fused"),
    "glm4": Family(
        (
            "input_layernorm",
            "post_self_attn_layernorm",
            "post_attention_layernorm",
            "post_mlp_layernorm",
        ),
        mlp="fused",
    ),
    "vaultgemma": Family(
        ("input_layernorm", None, "pre_feedforward_layernorm", None),
        "gemma",
        activation_key="hidden_activation",
        scales=Scales(embed=_sqrt_hidden),
    ),
    "granite": Family(
        PRE,
        scales=Scales(
            _constant("embedding_multiplier", 1.0),
            _constant("residual_multiplier", 1.0),
            _divided_by("logits_scaling"),
        ),
    ),
    "cohere": COHERE,
    "cohere2": COHERE,
    "cohere_compass_text": dataclasses.replace(
        COHERE, scales=Scales(logits=_constant("logit_scale"))
    ),
    "hyperclovax": Family(
        PRE,
        scales=Scales(
            _constant("embedding_multiplier", 1.0),
            _constant("residual_multiplier", 1.0),
            _constant("logits_scaling", 1.0),
        ),
        adapt=_hyperclovax,
    ),
    "minicpm3": Family(
        PRE, scales=Scales(_constant("scale_emb", 12), _minicpm3_residual, _minicpm3_logits)
    ),
    "nanochat": Family(
        ("input_layernorm", None, "post_attention_layernorm", None),
        "rms_without_weights",
        mlp="plain",
        mlp_names=("mlp.fc1", "mlp.fc2"),
        top=Top(embed_norm="model.norm"),
    ),
    "nemotron": Family(
        PRE, "layer_1p", "norm_eps", mlp="plain", mlp_names=("mlp.up_proj", "mlp.down_proj")
    ),
    "olmo": Family(PRE, "float32_layer_without_weights", eps=1e-5),
    "diffllama": LLAMA,
}
FAMILIES["granite_swa"] = FAMILIES["granite"]
"""The families whose decoder layers mha writes out, by ``model_type``; others are
refused by name."""
# Gemma 4 (its norms' weights as they are, layer scalars, per-layer inputs but in unified,
# experts beside the MLP with enable_moe_block) and Gemma 3n (AltUp and LAuReL too): .gemma
GEMMA4 = dataclasses.replace(GEMMA, norm="gemma4", stages=Stages(scalar=True))
FAMILIES["gemma4_text"] = GEMMA4
FAMILIES["gemma4_unified_text"] = dataclasses.replace(
    GEMMA4, stages=Stages(per_layer=False, scalar=True)
)
# CPM-Ant's decoder is a class of its own (.cpmant.CpmAntDecoder, which Decoder returns for
# it); its row names its norms and MLP for the tables that list every family
FAMILIES["cpmant"] = Family(
    ("self_att.layernorm_before_attention", None, "ffn.layernorm_before_ffn", None),
    eps_key="eps",
    mlp_names=("ffn.ffn.w_in.w_0", "ffn.ffn.w_in.w_1", "ffn.ffn.w_out"),
    activation="gelu",
)
FAMILIES["gemma3n_text"] = dataclasses.replace(
    GEMMA, norm="gemma4", residual="altup", stages=Stages(clamp=True)
)


def _not_written() -> dict[str, str]:
    """What each family whose attention mha reads lacks here: a hybrid's other layers
    (Mamba, linear attention, convolutions: named by the reader's row; Falcon-H1's Mamba
    beside its attention), else its mixture of experts (each a router and experts of its own
    kind)."""
    from ..integrations.readers import FAMILIES as READERS

    reasons = {}
    for kind, reader in READERS.items():
        if kind in FAMILIES:
            continue
        if kind in OWN_REASONS:
            reasons[kind] = OWN_REASONS[kind]
        elif reader.hybrid is not None:
            others = ", ".join(sorted(set(reader.hybrid.others.values())))
            reasons[kind] = f"its layers that are not attention ({others})"
        else:
            reasons[kind] = MIXTURE
    return reasons


MIXTURE = "its mixture of experts (a router and experts of its own kind)"
OWN_REASONS = {
    "falcon_h1": "its Mamba-2 mixer, which runs beside the attention in each layer",
    "hrm_text": "its recurrent L and H stacks (each layer run once a cycle)",
    "doge": "its dynamic mask attention's decoder (and its experts when is_moe)",
    "bitnet": "its MLP's RMSNorm before down_proj (ffn_sub_norm) and its attention's output "
    "norm in the decoder",
    "dory": "its nGPT decoder (hidden states on the unit sphere, moved toward each block's "
    "output at the rates lambda_1 and lambda_2; the MLP's suv scales; the logits' scale) and "
    "its recurrent section run n_recurrent_loops times",
}
"""What the families that are neither a mixture nor a hybrid of the readers' kind lack."""


# ---------------------------------------------------------------- positions, heads and activations
# of the older families and ModernBERT's decoder


@dataclass(frozen=True)
class HeadStage:
    """A dense layer, its activation and a norm between the final norm and the head
    (ModernBERT's ``lm_head``): ``norm(act(dense(x)))``, the tensors ``{name}.dense`` and
    ``{name}.norm``, the activation the config's ``activation_key``."""

    name: str
    activation_key: str


def _scale_embedding(get: Config) -> float | None:
    """``sqrt(hidden_size)`` where the config's ``scale_embedding`` says so (BioGPT, XGLM)."""
    return _sqrt_hidden(get) if get("scale_embedding", False) else None


def _ctrl(family: Family, get: Config) -> Family:
    """CTRL's layers' norms have an eps of 1e-6 whatever the config says; its final norm the
    config's ``layer_norm_epsilon``."""
    _refuse(get, "layer_norm_epsilon", 1e-6, "CTRL's final norm with an eps of its own")
    return family


FAMILIES.update({
    "ctrl": Family(
        ("layernorm1", None, "layernorm2", None), "layer", eps=1e-6, mlp="plain",
        mlp_names=("ffn.0", "ffn.2"), activation="relu",
        top=Top("transformer.h", "transformer.w", "transformer.layernorm", "lm_head",
                Positions("ctrl")),
        scales=Scales(embed=_sqrt_hidden), adapt=_ctrl,
    ),
    "biogpt": Family(
        ("self_attn_layer_norm", None, "final_layer_norm", None), "layer", eps=1e-5, mlp="plain",
        mlp_names=("fc1", "fc2"),
        top=Top("biogpt.layers", "biogpt.embed_tokens", "biogpt.layer_norm", "output_projection",
                Positions("learned", "biogpt.embed_positions", offset=2)),
        scales=Scales(embed=_scale_embedding),
    ),
    "xglm": Family(
        ("self_attn_layer_norm", None, "final_layer_norm", None), "layer", eps=1e-5, mlp="plain",
        mlp_names=("fc1", "fc2"), activation_key="activation_function",
        top=Top("model.layers", "model.embed_tokens", "model.layer_norm",
                positions=Positions("sinusoidal", offset=2, padding_key="pad_token_id")),
        scales=Scales(embed=_scale_embedding),
    ),
    "modernbert-decoder": Family(
        ("attn_norm", None, "mlp_norm", None), "layer", "norm_eps", mlp="glu",
        mlp_names=("mlp.Wi", "mlp.Wo"), activation_key="hidden_activation",
        first_norms=(None, None, "mlp_norm", None),
        top=Top("model.layers", "model.embeddings.tok_embeddings", "model.final_norm", "decoder",
                embed_norm="model.embeddings.norm",
                before_head=HeadStage("lm_head", "classifier_activation")),
    ),
    "mpt": Family(
        ("norm_1", None, "norm_2", None), "layer", "layer_norm_epsilon", mlp="plain",
        mlp_names=("ffn.up_proj", "ffn.down_proj"), activation="gelu",
        top=Top("transformer.blocks", "transformer.wte", "transformer.norm_f"),
    ),
    "gpt_neox_japanese": Family(
        PRE, "layer", "layer_norm_eps", mlp="plain",
        mlp_names=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"),
        top=Top("gpt_neox_japanese.layers", "gpt_neox_japanese.embed_in",
                "gpt_neox_japanese.final_layer_norm", "embed_out"),
    ),
    "apertus": Family(
        ("attention_layernorm", None, "feedforward_layernorm", None), mlp="plain",
        mlp_names=("mlp.up_proj", "mlp.down_proj"),
    ),
    "exaone": Family(
        ("ln_1", None, "ln_2", None), mlp_names=("mlp.c_fc_0", "mlp.c_fc_1", "mlp.c_proj"),
        top=Top("transformer.h", "transformer.wte", "transformer.ln_f"),
    ),
})  # fmt: skip
FAMILIES["apertus1p5_text"] = FAMILIES["apertus"]

NOT_WRITTEN = _not_written()
"""The families whose attention ``from_pretrained`` reads but whose decoder mha.models does
not write out, each with what it lacks."""
