"""Doge's dynamic mask attention (:class:`mha.DynamicMaskAttention`, ``doge``): a bias of
each key from its values added to the scores, each query's ``keep_window_size`` keys of the
largest bias kept. Its layers are compared with transformers' (whole sequences, decoding,
the top-k past 6 keys) in test_pretrained.py and their gradients, the values' two paths
among them, with torch.autograd in test_pretrained_gradients.py; here, that the bias matters,
how equal biases are kept, decoding against whole sequences, and the refusals."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError

B, L, PREFILL = 2, 24, 10


@functools.cache
def oracle():
    from support.rope_oracle import float64_rotary

    model = models.transformers_model("doge")
    float64_rotary(model)
    return models.decoding_calls(model, B, L, PREFILL)


def load(layer, folder=None):
    folder = models.saved("doge") if folder is None else folder
    return mha.from_pretrained(folder, layer=layer, dtype=np.float64)


def test_the_bias_from_the_values_matters(transformers):
    """Each layer without its bias (``A`` zero: a bias of one, the same for every key)
    differs from transformers'; the top-k is then by equal biases, the earliest keys."""
    for layer, calls in oracle().items():
        x, expected = calls[0]
        attention = load(layer)
        assert type(attention) is mha.DynamicMaskAttention
        assert attention.keep_window_size == 6 and attention.b_dt is not None
        assert relative_error(attention(x, mask=True), expected) <= 1e-12
        attention.A[:] = 0.0
        assert relative_error(attention(x, mask=True), expected) > 1e-4, layer


def _layer(keep=None, **options):
    return mha.DynamicMaskAttention(
        16, 4, num_kv_heads=2, keep_window_size=keep, dt_bias=True, seed=3,
        rope_theta=100.0, dtype=np.float64, **options,
    )  # fmt: skip


def test_equal_biases_keep_the_earlier_keys():
    """With ``W_dt`` zero every key of a head has the same bias: each query keeps its first
    ``keep_window_size`` keys, as a plain layer masked to them computes."""
    layer = _layer(keep=3)
    layer.W_dt[:] = 0.0
    x = np.random.default_rng(0).standard_normal((2, 7, 16))
    plain = mha.MultiHeadAttention.from_spec(
        mha.LayerSpec(
            **{name: getattr(layer.spec, name) for name in mha.LayerSpec.__dataclass_fields__}
        ),
        {name: w for name, w in layer.weights().items() if name not in ("W_dt", "b_dt", "A")},
    )
    first = np.tril(np.ones((7, 7), bool)) & (np.arange(7) < 3)  # causal, the first 3 keys
    assert relative_error(layer(x, mask=True), plain(x, mask=first)) <= 1e-14


@pytest.mark.parametrize("keep", [None, 2, 5])
def test_decoding_matches_the_whole_sequence(keep):
    """Prefill then steps on a cache: the bias of the cached keys from their cached values,
    the top-k over every key so far."""
    layer = _layer(keep)
    x = np.random.default_rng(1).standard_normal((2, 9, 16))
    whole = layer(x, mask=True)
    cache = layer.new_cache(2)
    steps = [layer(x[:, :4], cache=cache)] + [
        layer(x[:, t : t + 1], cache=cache) for t in range(4, 9)
    ]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    assert cache.lengths.tolist() == [9, 9]


def test_the_gradient_of_the_bias_reaches_the_values():
    """The backward against central differences of the loss (float64): ``A``, ``W_dt``,
    ``b_dt``, ``W_v`` (two paths) and the input."""
    layer = _layer(keep=3)
    g = np.random.default_rng(2)
    x, grad_out = g.standard_normal((1, 6, 16)), g.standard_normal((1, 6, 16))
    _, backward = layer(x, mask=True, return_backward=True)
    grads = backward(grad_out)

    def loss():
        return float((layer(x, mask=True) * grad_out).sum())

    h = 1e-6
    for name in ("A", "W_dt", "b_dt", "W_v"):
        W = getattr(layer, name)
        for index in [(0,), (1,)] if W.ndim == 1 else [(0, 0), (5, 1), (3, 0)]:
            keep = W[index]
            W[index] = keep + h
            up = loss()
            W[index] = keep - h
            down = loss()
            W[index] = keep
            assert abs((up - down) / (2 * h) - grads[name][index]) < 1e-6, (name, index)
    shared = grads["query"] + grads["key"] + grads["value"]
    x0 = x[0, 2, 5]
    x[0, 2, 5] = x0 + h
    up = loss()
    x[0, 2, 5] = x0 - h
    down = loss()
    x[0, 2, 5] = x0
    assert abs((up - down) / (2 * h) - shared[0, 2, 5]) < 1e-6


def test_what_it_does_not_compute_is_refused_by_name(tmp_path, transformers):
    layer = _layer(keep=2)
    x = np.ones((2, 3, 16))
    with pytest.raises(AttentionValueError, match="dynamic mask attention is causal"):
        layer(x, mask=False)
    paged = mha.PagedKVCache(8, 4, 2, 4, dtype=np.float64)
    with pytest.raises(AttentionValueError, match=r"give a mha\.KVCache from new_cache"):
        layer(x, cache=paged)
    cache = layer.new_cache(2)
    layer(x, cache=cache)
    cache.truncate([3, 2])
    with pytest.raises(AttentionValueError, match=r"sequences of different lengths \(\[3, 2\]\)"):
        layer(x[:, :1], cache=cache)
    with pytest.raises(AttentionValueError, match="with a window or sink tokens"):
        _layer(keep=2, window=4)
    folder = shutil.copytree(models.saved("doge"), tmp_path / "doge")
    with pytest.raises(AttentionValueError, match=r"load it with mha\.DynamicMaskAttention"):
        mha.MultiHeadAttention.from_pretrained(folder, layer=0)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
    with pytest.raises(
        AttentionValueError, match=r"sliding_window=4 \(a window under Doge's"
    ) as error:
        load(0, folder)
    assert str(folder) in str(error.value)
