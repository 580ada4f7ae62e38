"""Every public keyword reaches the checked spec, or is refused by name: the entry points
gather their keywords into one record of their signature (mha.api.spec), and the copies that
once drifted (mha.dask's, the module's) read the same records."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest

import mha
from mha.api.checks import LayerWeights
from mha.api.spec import MhaKeywords, SdpaKeywords, check_mha, check_sdpa


def _mha_dask():
    """mha.dask where the dask extra is installed; a skip without it (a failure where CI
    sets MHA_REQUIRE_DASK=1)."""
    if os.environ.get("MHA_REQUIRE_DASK") != "1":
        pytest.importorskip("dask.array", reason="the dask extra is not installed")
    import mha.dask

    return mha.dask


SDPA = [name for name in inspect.signature(mha.scaled_dot_product_attention).parameters][3:]
LAYER = [name for name in inspect.signature(mha.multi_head_attention).parameters][8:]
WEIGHTS = [name for name in LayerWeights._fields if name not in ("W_q", "W_k", "W_v", "W_o")]


def test_the_records_are_the_signatures():
    """A keyword added to an entry point without its record (or the reverse) fails here."""
    assert list(SdpaKeywords._fields) == SDPA
    assert sorted(MhaKeywords._fields) == sorted(set(LAYER) - set(WEIGHTS))
    dask = _mha_dask()
    assert [*SDPA, "split_every"] == list(
        inspect.signature(dask.scaled_dot_product_attention).parameters
    )[3:]
    assert [*LAYER, "split_every"] == list(inspect.signature(dask.multi_head_attention).parameters)[
        8:
    ]


def test_the_layer_takes_every_keyword_of_the_function():
    """Each of the function's keywords is the module's configuration, one of its weights,
    or a keyword of its forward."""
    configuration = set(inspect.signature(mha.MultiHeadAttention).parameters)
    forward = set(inspect.signature(mha.MultiHeadAttention.forward).parameters)
    attributes = {"b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v", "q_norm", "k_norm", "sinks",
                  "W_g", "b_g", "q_norm_bias", "k_norm_bias", "o_norm", "q_scale"}  # fmt: skip
    covered = configuration | forward | attributes | {"rope_scaling", "add_zero_attn"}
    assert set(LAYER) - covered == set()


def _probes(rng, B=1, H=2, L=4, d=4):
    """For each keyword, ``(probe, baseline)``: keywords with it and the same without it (its
    companions in both), whose results differ when it reaches the spec; a keyword refused
    with its companions is refused by name."""
    grad = lambda s, b, h, i, j: np.full_like(s, 2.0)  # noqa: E731
    cache = lambda: mha.KVCache(B, H, d)  # noqa: E731
    table = {
        "mask": {"mask": rng.random((B, 1, L, L)) < 0.6}, "causal": {"causal": True},
        "causal_alignment": ({"causal": True, "causal_alignment": "top_left"},
                             {"causal": True}),
        "key_lengths": {"key_lengths": [2]}, "query_lengths": {"query_lengths": [2]},
        "bias": {"bias": rng.standard_normal((B, H, L, L))}, "window": {"window": 2},
        "sink_tokens": ({"causal": True, "window": 1, "sink_tokens": 1},
                        {"causal": True, "window": 1}),
        "chunk": {"chunk": 2}, "mask_mod": {"mask_mod": lambda b, h, i, j: i >= j},
        "sinks": {"sinks": rng.standard_normal(H)}, "softcap": {"softcap": 0.5},
        "alibi": {"alibi": True}, "score_mod": {"score_mod": lambda s, b, h, i, j: s * 2.0},
        "score_mod_grad": ({"score_mod": lambda s, b, h, i, j: s * 2.0,
                            "score_mod_grad": grad, "return_backward": True},
                           {"score_mod": lambda s, b, h, i, j: s * 2.0,
                            "score_mod_grad": lambda s, b, h, i, j: np.ones_like(s),
                            "return_backward": True}),
        "query_temperature": {"query_temperature": (0.5, 2.0)},
        "scale": {"scale": 0.3}, "return_weights": {"return_weights": True},
        "return_lse": {"return_lse": True}, "return_backward": {"return_backward": True},
        "lse_base": ({"return_lse": True, "lse_base": 2}, {"return_lse": True}),
        "dropout_p": ({"dropout_p": 0.5, "generator": np.random.default_rng(0)},
                      {"dropout_p": 0.0, "generator": np.random.default_rng(0)}),
        "generator": ({"dropout_p": 0.5, "generator": np.random.default_rng(0)},
                      {"dropout_p": 0.5, "generator": np.random.default_rng(1)}),
        "cache": ({"cache": cache()}, {}),
        "padding_side": ({"cache": cache(), "query_lengths": [2], "padding_side": "left"},
                         {"cache": cache(), "query_lengths": [2]}),
    }  # fmt: skip
    return {name: entry if isinstance(entry, tuple) else (entry, {}) for name, entry in
            table.items()}  # fmt: skip


RUNTIME = ("max_memory", "workers")
"""Keywords that never change a result (bitwise reproducible for fixed values of them):
they must reach the request."""


def _value(result):
    """A result with its backward called (on ones), its dropout drawn: arrays to compare."""
    parts = result if isinstance(result, tuple) else (result,)
    out = []
    for part in parts:
        if callable(part):
            grads = part(np.ones_like(parts[0]))
            out.extend(grads[name] for name in sorted(grads))
        else:
            out.append(np.asarray(part))
    return out


def _reaches_or_refused(call, probe, baseline):
    try:
        result = _value(call(**probe))
    except mha.AttentionError:
        return True  # refused, by name: the tests of each keyword check the message
    expected = _value(call(**baseline))
    return len(result) != len(expected) or any(
        a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(result, expected,
                                                                         strict=False)
    )  # fmt: skip


@pytest.mark.parametrize("name", SDPA)
def test_every_keyword_of_the_core_reaches_its_spec_or_is_refused(name):
    if name in RUNTIME:
        request = check_sdpa(SdpaKeywords(**{name: 7})).request
        assert getattr(request, {"max_memory": "budget", "workers": "threads"}[name]) == 7
        return
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 4, 4))
    probe, baseline = _probes(rng)[name]

    def call(**keywords):  # 3 queries over 4 keys (the alignments differ), or with a cache
        rows = q if "cache" in keywords else q[:, :, :3]  # the new tokens' own
        return mha.scaled_dot_product_attention(rows, k, v, **keywords)

    assert _reaches_or_refused(call, probe, baseline)


@pytest.mark.parametrize("name", SDPA)
def test_every_keyword_of_the_dask_core_reaches_its_spec_or_is_refused(name):
    dask = _mha_dask()
    if name in RUNTIME:
        return  # the same record as the in-memory core's (test_the_records_are_the_signatures)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 4, 4))
    probe, baseline = _probes(rng)[name]

    def call(**keywords):  # 3 queries over 4 keys: the alignments differ
        result = dask.scaled_dot_product_attention(q[:, :, :3], k, v, **keywords)
        parts = result if isinstance(result, tuple) else (result,)
        computed = tuple(x.compute(scheduler="sync") for x in parts)
        return computed if isinstance(result, tuple) else computed[0]

    assert _reaches_or_refused(call, probe, baseline)


def _layer_probes(rng):
    """``(probe, baseline)`` for the layer's own keywords, as :func:`_probes`."""
    theta = {"rope_theta": 100.0}
    head, kv = rng.standard_normal(4), rng.standard_normal(8)
    norms = {"q_norm": rng.standard_normal(4), "k_norm": rng.standard_normal(4)}
    gate = rng.standard_normal((8, 2))  # a gate per head
    layer_norms = {**norms, "qk_layernorm": True}
    return {
        **{name: {name: rng.standard_normal(8)} for name in ("b_q", "b_k", "b_v", "b_o")},
        "bias_k": ({"bias_k": kv, "bias_v": kv}, {}),
        "bias_v": ({"bias_k": kv, "bias_v": -kv}, {"bias_k": kv, "bias_v": kv}),
        "add_zero_attn": {"add_zero_attn": True},
        "num_kv_heads": ({"num_kv_heads": 1, "W_k": "half", "W_v": "half"}, {}),
        "rope_theta": theta, "rotary_dim": ({**theta, "rotary_dim": 2}, theta),
        "rotary_interleaved": ({**theta, "rotary_interleaved": True}, theta),
        "rope_scaling": ({**theta, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                         theta),
        "positions": ({**theta, "positions": [3, 1, 2, 0]}, theta),
        "q_norm": (norms, {}), "k_norm": ({**norms, "k_norm": head}, norms),
        "qk_norm": ({"q_norm": kv, "k_norm": kv, "qk_norm": "all"}, {}),
        "qk_norm_eps": ({**norms, "qk_norm_eps": 0.5}, norms),
        "qk_norm_offset": ({**norms, "qk_norm_offset": 1.0}, norms),
        "W_g": {"W_g": rng.standard_normal((8, 8))},
        "b_g": ({"W_g": gate, "b_g": rng.standard_normal(2)}, {"W_g": gate}),
        "output_gate": ({"W_g": gate, "output_gate": "softplus"}, {"W_g": gate}),
        "clip_qkv": {"clip_qkv": 0.5},
        "v_norm": {"v_norm": 1e-6},
        "qk_layernorm": ({**norms, "qk_layernorm": True}, norms),
        "qk_norm_after_rope": ({**theta, **norms, "qk_norm_after_rope": True}, {**theta, **norms}),
        "q_norm_bias": ({**layer_norms, "q_norm_bias": head, "k_norm_bias": head}, layer_norms),
        "k_norm_bias": ({**layer_norms, "q_norm_bias": head, "k_norm_bias": -head},
                        {**layer_norms, "q_norm_bias": head, "k_norm_bias": head}),
        "o_norm": ({"output_norm": "rms", "o_norm": kv}, {"output_norm": "rms", "o_norm": -kv}),
        "output_norm": {"output_norm": "l2"},
        "q_scale": ({**theta, "q_scale": kv}, theta),
        "output_norm_eps": ({"output_norm": "l2", "output_norm_eps": 0.5}, {"output_norm": "l2"}),
    }  # fmt: skip


@pytest.mark.parametrize("dask", [False, True], ids=["in memory", "dask"])
@pytest.mark.parametrize("name", LAYER)
def test_every_keyword_of_the_layer_reaches_its_spec_or_is_refused(name, dask):
    if dask:
        mha_dask = _mha_dask()
    if name in RUNTIME:
        request = check_mha(MhaKeywords(**{name: 7})).request
        assert getattr(request, {"max_memory": "budget", "workers": "threads"}[name]) == 7
        return
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1, 4, 8))
    W = dict(zip(("W_q", "W_k", "W_v", "W_o"), rng.standard_normal((4, 8, 8)), strict=True))
    entry = {**_probes(rng), **_layer_probes(rng)}[name]
    probe, baseline = entry if isinstance(entry, tuple) else (entry, {})
    if name == "bias":
        probe = {"bias": rng.standard_normal((1, 2, 4, 4))}

    def call(**keywords):
        weights = dict(W)
        for key in ("W_k", "W_v"):  # num_kv_heads=1: one head's columns
            if keywords.get(key) == "half":
                weights[key] = W[key][:, :4]
                del keywords[key]
        Q = X if "cache" in keywords or "positions" in keywords else X[:, :3]  # 3 over 4 keys
        arguments = (Q, X, X, weights["W_q"], weights["W_k"], weights["W_v"], weights["W_o"], 2)
        if dask:
            result = mha_dask.multi_head_attention(*arguments, **keywords)
            return result.compute(scheduler="sync")
        return mha.multi_head_attention(*arguments, **keywords)

    assert _reaches_or_refused(call, probe, baseline)
