"""``MultiHeadAttention.from_pretrained``'s backward against torch.autograd through the
layers of transformers' own models, in float64: QK-norm per head (Qwen3), with ``1 + w``,
``query_pre_attn_scalar`` and the local rope base (Gemma 3), across heads (OLMo 2), Llama 3's
rope scaling, gpt-oss's sinks and yarn, on a sliding and a full layer where the family has
both; MiniMax-M3's block-sparse layer, given the blocks its indexer chose (whose weights
have no gradient).

The models are the tiny bfloat16 checkpoints of support.pretrained_models, loaded by
transformers in float64 with the float64 rotary of support.rope_oracle, as in
test_pretrained.py. A forward hook on each layer's ``self_attn`` captures the keywords the
decoder gives it in a model forward (the position embeddings of its layer type, its causal
or sliding mask); the attention is then called again with those keywords and a random leaf
hidden state (24 positions, past ``original_max_position_embeddings`` of 16 and every
sliding window), under ``float64_torch`` so that the RMSNorms' float32 upcast stays float64,
and ``(out * grad_out).sum()`` is differentiated. Every parameter's gradient (weights
transposed: mha's ``W_q`` is ``q_proj.weight.T``) and the hidden state's (the sum of mha's
``query``, ``key`` and ``value`` gradients) must agree to 1e-10.

The latent attentions' (``mha.LatentAttention``) are checked the same way beside their
readers: DeepSeek-V3.2's and GLM-MoE-DSA's in test_sparse.py, Bailing-hybrid's in
test_gated.py, A.X-K2's (layers 0, 2) and dots3's (an indexed layer 0, a sliding layer 2)
in test_latentgates.py, HY-V4's in test_hyv4.py, every weight laid out as the reader lays
out its tensor. Dory's (its ``sqk`` and ``s_gate`` folded into ``q_scale`` and ``W_g``, their
gradients by the chain rule) are checked in test_dory.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha

B, L = 2, 24
FORWARD_TOLERANCE = 1e-12
TOLERANCE = 1e-10

SLIDING, FULL = "sliding_attention", "full_attention"
CASES = [  # family, layer, its type: a sliding and a full layer where the family has both
    ("qwen3", 0, FULL),
    ("qwen3", 1, SLIDING),
    ("gemma3", 0, SLIDING),  # the local rope base
    ("gemma3", 1, FULL),
    ("olmo2", 0, FULL),
    ("llama", 0, FULL),  # Llama 3 rope scaling
    ("gpt_oss", 0, SLIDING),
    ("gpt_oss", 1, FULL),
    ("bitnet", 1, FULL),  # the RMSNorm of the joined heads before o_proj
    ("minimax_m3_vl_text", 0, "minimax_m3_sparse"),  # given its indexer's choice of blocks
    ("hrm_text", 2, FULL),  # the H stack's first layer (a gate of every feature)
    ("doge", 1, FULL),  # the dynamic mask: the values' gradient through the bias too
]


def mha_name(name):
    """mha's name of a transformers attention parameter, and whether it is transposed."""
    if name.startswith("dt_proj.") or name == "A":  # Doge's dynamic mask
        return {"dt_proj.weight": ("W_dt", True), "dt_proj.bias": ("b_dt", False)}.get(
            name, (name, False)
        )
    if name.endswith("_proj.weight"):
        return f"W_{name[0]}", True
    if name.endswith("_proj.bias"):
        return f"b_{name[0]}", False
    if name in ("q_norm.weight", "k_norm.weight"):
        return name.removesuffix(".weight"), False
    if name == "sinks":
        return name, False
    if name == "attn_sub_norm.weight":  # BitNet's output norm
        return "o_norm", False
    raise KeyError(f"no mha name for the attention parameter {name!r}")


def captured(family):
    """The float64 transformers model of ``family`` and, for each layer, the keywords its
    ``self_attn`` got in a forward over ``B`` sequences of ``L`` tokens."""
    return models.captured(family, B, L)


@pytest.mark.parametrize(("family", "layer", "kind"), CASES)
def test_gradients_match_autograd_through_transformers_layers(
    family, layer, kind, torch, transformers, record_error
):
    from support.rope_oracle import float64_torch

    model, calls = captured(family)
    config = model.config
    assert (getattr(config, "layer_types", None) or [FULL] * (layer + 1))[layer] == kind
    attention_module = models.attention_modules(model)[layer]
    keywords = {**calls[layer], "cache": None}
    assert keywords["hidden_states"].shape == (B, L, config.hidden_size)
    g = np.random.default_rng(len(family) * 10 + layer)
    x = 0.7 * g.standard_normal((B, L, config.hidden_size))
    grad_out = g.standard_normal((B, L, config.hidden_size))

    # an indexer's choice has no gradient (MiniMax-M3's: block indices)
    parameters = {
        name: p
        for name, p in attention_module.named_parameters()
        if not name.startswith("indexer.")
    }
    attention_module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = attention_module(**{**keywords, "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()
    assert expected.dtype == torch.float64

    attention = mha.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    error = relative_error(out, expected.detach().numpy())
    forward = f"pretrained {family} gradients forward, float64"
    assert record_error(forward, error) <= FORWARD_TOLERANCE, (family, layer)
    grads = backward(grad_out)

    names = {name: mha_name(name) for name in parameters}
    assert set(grads) == {ours for ours, _ in names.values()} | {"query", "key", "value"}
    label = f"pretrained {family} gradients vs autograd, float64"
    weights = attention.parameters()
    for name, parameter in parameters.items():
        ours, transposed = names[name]
        value = parameter.detach().numpy()
        assert np.array_equal(weights[ours], value.T if transposed else value), name
        theirs = parameter.grad.numpy()
        expected_grad = theirs.T if transposed else theirs
        assert np.abs(expected_grad).max() > 1e-3, name  # every gradient matters
        error = relative_error(grads[ours], expected_grad)
        assert record_error(label, error) <= TOLERANCE, (family, layer, name, error)
    shared = grads["query"] + grads["key"] + grads["value"]
    error = relative_error(shared, tx.grad.numpy())
    assert record_error(label, error) <= TOLERANCE, (family, layer, "hidden_states", error)
