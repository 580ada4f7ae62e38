"""The families mha refuses by ``model_type``, each with the feature that blocks it, as
transformers 5.24 computes it: what their attention does that mha does not (an output gate,
top-k sparse attention), the layers that are not attention at all (Mamba,
linear attention, short convolutions), or what the checkpoint is instead of a decoder-only
text model (an encoder, an encoder-decoder's decoder, a multimodal wrapper). A family whose
attention mha could compute once a row reads it is not here: it is refused as "not supported"
until then.

>>> REFUSED["deepseek_v4"].split(" (")[0]
"DeepSeek-V4's attention over compressed keys with top-k sparse attention"
>>> REFUSED["bart"]
'a decoder of an encoder-decoder model: mha reads decoder-only families'
"""

from __future__ import annotations

__all__ = ["ENCODERS", "REFUSED", "SEQ2SEQ"]

SEQ2SEQ = (
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "blt", "marian", "mbart",
    "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "trocr", "whisper",
)  # fmt: skip
"""The decoders of encoder-decoder models in transformers' causal-LM mapping."""
ENCODERS = (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
    "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
    "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod",
)  # fmt: skip
"""The encoders that transformers' causal-LM mapping runs as decoders (``is_decoder``)."""

_SEQ2SEQ = "a decoder of an encoder-decoder model: mha reads decoder-only families"
_ENCODER = (
    "an encoder run as a decoder (bidirectional self-attention, cross-attention to an "
    "encoder's output): mha reads decoder-only families"
)


def _multimodal(name: str, text: str) -> str:
    return (
        f"this is the multimodal {name}; mha reads decoder-only text checkpoints (its text "
        f"model's model_type is {text})"
    )


def _without_attention(what: str) -> str:
    return f"{what}, with no attention layers"


def _not_computed(what: str) -> str:
    return f"{what}, which mha does not compute"


_TOP_K = "top-k sparse attention (an indexer picks the keys each query attends to)"
_MAMBA = "Mamba state-space layers between its attention layers"
REFUSED = {
    # decoder-only families whose attention (or other layers) mha does not compute
    "deepseek_v4": _not_computed(f"DeepSeek-V4's attention over compressed keys with {_TOP_K}"),
    "reformer": _not_computed("Reformer's LSH and chunked local attention"),
    "jetmoe": _not_computed(
        "JetMoE's mixture of attention heads (experts pick each token's query and output "
        "projections)"
    ),
    "inkling_text": _not_computed(
        "Inkling's relative-position logits, computed from each query's hidden state "
        "(r_proj times the bank rel_logits_proj.proj, one logit per backward distance below "
        "rel_extent: no learned table of buckets), and its short convolutions of the keys and "
        "values (k_sconv, v_sconv: causal depthwise conv1d with a cached state)"
    ),
    "inkling2_text": _not_computed(
        "Inkling2's relative position bias, computed from each query's hidden state "
        "(relative_position_bias: a linear map, a position-scaled norm, then the bank proj, "
        "one logit per backward distance below rel_extent: no learned table of buckets), and "
        "its short convolutions of the projections (sconv: causal depthwise conv1d with a "
        "cached state)"
    ),
    "inkling2_loop_text": _not_computed(
        "Inkling2-Loop's relative position bias, computed from each query's hidden state "
        "(relative_position_bias: a linear map, a position-scaled norm, then the bank proj, "
        "one logit per backward distance below rel_extent: no learned table of buckets), and "
        "its short convolutions of the projections (sconv: causal depthwise conv1d with a "
        "cached state)"
    ),
    "zaya": _not_computed(
        "ZAYA's compressed convolutional attention (queries and keys through convolutions)"
    ),
    # not a decoder-only text model
    **dict.fromkeys(SEQ2SEQ, _SEQ2SEQ),
    **dict.fromkeys(ENCODERS, _ENCODER),
    "mamba": _without_attention("a Mamba state-space model"),
    "mamba2": _without_attention("a Mamba-2 state-space model"),
    "falcon_mamba": _without_attention("a Mamba state-space model"),
    "rwkv": _without_attention("RWKV's recurrent time mixing"),
    "xlstm": _without_attention("xLSTM's recurrent cells"),
    "gemma3": _multimodal("Gemma 3", "gemma3_text, Gemma3ForCausalLM"),
    "gemma3n": _multimodal("Gemma 3n", "gemma3n_text"),
    "gemma4": _multimodal("Gemma 4", "gemma4_text"),
    "gemma4_unified": _multimodal("Gemma 4 unified", "gemma4_unified_text"),
    "gemma4_assistant": _multimodal("Gemma 4 assistant", "gemma4_text"),
    "gemma4_unified_assistant": _multimodal("Gemma 4 unified assistant", "gemma4_unified_text"),
    "qwen3_5": _multimodal("Qwen3.5", "qwen3_5_text"),
    "qwen3_5_moe": _multimodal("Qwen3.5-MoE", "qwen3_5_moe_text"),
    "qwen4_exp": _multimodal("Qwen4-Exp", "qwen4_exp_text"),
    "dots3_note": _multimodal("dots3", "dots3_note_text"),
    "llama4": _multimodal("Llama 4", "llama4_text"),
    "fuyu": _multimodal("Fuyu", "persimmon"),
    "got_ocr2": _multimodal("GOT-OCR2", "qwen2"),
    "emu3": _multimodal("Emu3", "emu3_text_model"),
    "mllama": "this is the multimodal Llama 3.2 Vision: its text model has cross-attention "
    "layers to the image, which mha does not read",
    "git": "this is the multimodal GIT: its BERT-like text decoder attends to the image "
    "tokens; mha reads decoder-only families",
    "moshi": "this is the multimodal Moshi (speech): mha reads decoder-only text families",
    "moss_transcribe_diarize": "this is the multimodal MOSS transcription model (speech): mha "
    "reads decoder-only text families",
    "phi4_multimodal": "this is the multimodal Phi-4 (LoRA adapters for vision and speech on "
    "its projections): mha reads decoder-only text families",
    "qwen2_vl": "Qwen2-VL's multimodal rope (mrope) is not supported",
    "qwen2_5_vl": "Qwen2.5-VL's multimodal rope (mrope) is not supported",
}
"""Families refused with a reason beyond "not supported", by ``model_type``."""
