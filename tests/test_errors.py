"""Every mistake a caller can make gets an AttentionError that names the argument and shapes."""

from __future__ import annotations

import re

import numpy as np
import pytest

import mha
from mha import AttentionError, AttentionTypeError, AttentionValueError, ShapeError

r = np.random.default_rng(0)
Q, K, V = r.standard_normal((2, 5, 8)), r.standard_normal((2, 6, 8)), r.standard_normal((2, 6, 8))
W = [r.standard_normal((8, 8)) for _ in range(4)]
q, k, v = Q.reshape(2, 1, 5, 8), K.reshape(2, 1, 6, 8), V.reshape(2, 1, 6, 8)


def call(*args, **kwargs):
    """multi_head_attention with the good arguments, some replaced."""
    names = ["Q", "K", "V", "W_q", "W_k", "W_v", "W_o", "num_heads"]
    values = dict(zip(names, [Q, K, V, *W, 2], strict=True))
    values.update(dict(zip(names, args, strict=False)))
    values.update({name: kwargs.pop(name) for name in list(kwargs) if name in values})
    return mha.multi_head_attention(*values.values(), **kwargs)


CASES = [
    # (id, thunk, exception type, a regular expression the message must match)
    (
        "num_heads zero",
        lambda: call(num_heads=0),
        AttentionValueError,
        r"num_heads must be a positive integer; got 0",
    ),
    (
        "num_heads float",
        lambda: call(num_heads=2.0),
        AttentionTypeError,
        r"num_heads must be a positive integer; got 2.0 of type float",
    ),
    ("num_heads bool", lambda: call(num_heads=True), AttentionTypeError, r"num_heads .* got True"),
    (
        "num_heads not dividing",
        lambda: call(num_heads=3),
        ShapeError,
        r"num_heads=3 does not divide the 8 columns of W_q \(W_q \(8, 8\)\)",
    ),
    (
        "num_heads not dividing W_v",
        lambda: call(W_v=r.standard_normal((8, 4)), W_o=r.standard_normal((4, 8)), num_heads=8),
        ShapeError,
        r"num_heads=8 does not divide the 4 columns of W_v",
    ),
    (
        "batch mismatch",
        lambda: call(K=K[:1], V=V[:1]),
        ShapeError,
        r"Q has batch shape \(2,\) but K has \(1,\) \(Q \(2, 5, 8\), K \(1, 6, 8\)\)",
    ),
    (
        "key/value length mismatch",
        lambda: call(V=V[:, :5]),
        ShapeError,
        r"K has 6 positions but V has 5 \(K \(2, 6, 8\), V \(2, 5, 8\)\)",
    ),
    (
        "Q width vs W_q",
        lambda: call(Q=Q[..., :6]),
        ShapeError,
        r"Q has width 6 but W_q has 8 rows \(Q \(2, 5, 6\), W_q \(8, 8\)\)",
    ),
    (
        "K width vs W_k",
        lambda: call(K=K[..., :3]),
        ShapeError,
        r"K has width 3 but W_k has 8 rows \(K \(2, 6, 3\), W_k \(8, 8\)\)",
    ),
    (
        "V width vs W_v",
        lambda: call(V=V[..., :3]),
        ShapeError,
        r"V has width 3 but W_v has 8 rows \(V \(2, 6, 3\), W_v \(8, 8\)\)",
    ),
    (
        "W_q vs W_k columns",
        lambda: call(W_k=W[1][:, :6]),
        ShapeError,
        r"W_q has 8 columns but W_k has 6 \(W_q \(8, 8\), W_k \(8, 6\)\)",
    ),
    (
        "W_v vs W_o",
        lambda: call(W_o=W[3][:6]),
        ShapeError,
        r"W_o has 6 rows but the 2 joined heads of width 4 \(from W_v \(8, 8\)\) feed it 8 "
        r"\(W_v \(8, 8\), W_o \(6, 8\)\)",
    ),
    (
        "Q rank",
        lambda: call(Q=Q[None]),
        ShapeError,
        r"Q must have shape \(B, L, d_q\) or \(L, d_q\); got shape \(1, 2, 5, 8\)",
    ),
    (
        "K rank unlike Q",
        lambda: call(K=K[0]),
        ShapeError,
        r"K must have shape \(B, S, d_kin\), like Q \(2, 5, 8\); got shape \(6, 8\)",
    ),
    (
        "weight rank",
        lambda: call(W_q=W[0][None]),
        ShapeError,
        r"W_q must have shape \(rows, columns\).*got shape \(1, 8, 8\)",
    ),
    (
        "b_q length",
        lambda: call(b_q=np.zeros(7)),
        ShapeError,
        r"b_q must have shape \(8,\) to match the columns of its weight \(8, 8\); got shape \(7,\)",
    ),
    (
        "mask does not broadcast",
        lambda: call(mask=np.ones((5, 5), bool)),
        ShapeError,
        r"mask of shape \(5, 5\) does not broadcast to the scores' shape \(B, H, L, S\) = "
        r"\(2, 2, 5, 6\)",
    ),
    (
        "3-D mask is (B, L, S)",
        lambda: call(mask=np.ones((2, 5, 5), bool)),
        ShapeError,
        r"a 3-D mask is read as \(B, L, S\)",
    ),
    (
        "mask with too many axes",
        lambda: call(mask=np.ones((1, 2, 2, 5, 6), bool)),
        ShapeError,
        r"mask of shape \(1, 2, 2, 5, 6\) does not broadcast",
    ),
    (
        "integer mask",
        lambda: call(mask=np.ones((5, 6), int)),
        AttentionTypeError,
        r"True = may attend; got an array of dtype int64\. For an additive mask .* bias=",
    ),
    (
        "float mask",
        lambda: call(mask=np.zeros((5, 6))),
        AttentionTypeError,
        r"boolean array with True = may attend.*float64.*bias=",
    ),
    ("string mask", lambda: call(mask="causal"), AttentionTypeError, r"got 'causal' of type str"),
    (
        "bias does not broadcast",
        lambda: call(bias=np.zeros((3, 5, 6))),
        ShapeError,
        r"bias of shape \(3, 5, 6\) does not broadcast .* \(2, 2, 5, 6\)",
    ),
    (
        "boolean bias",
        lambda: call(bias=np.zeros((5, 6), bool)),
        AttentionTypeError,
        r"bias has boolean dtype.*mask=",
    ),
    (
        "key_lengths too long",
        lambda: call(key_lengths=[7, 1]),
        AttentionValueError,
        r"key_lengths must be <= 6, the number of key positions "
        r"\(Q \(2, 5, 8\), K \(2, 6, 8\)\); got 7",
    ),
    (
        "key_lengths negative",
        lambda: call(key_lengths=[-1, 1]),
        AttentionValueError,
        r"key_lengths must be >= 0; got -1",
    ),
    (
        "key_lengths float",
        lambda: call(key_lengths=[1.0, 2.0]),
        AttentionTypeError,
        r"key_lengths must hold integers; got dtype float64",
    ),
    (
        "key_lengths bool",
        lambda: call(key_lengths=[True, False]),
        AttentionTypeError,
        r"key_lengths must hold integers; got dtype bool",
    ),
    (
        "key_lengths count",
        lambda: call(key_lengths=[1, 1, 1]),
        ShapeError,
        r"key_lengths must hold one length per sequence, shape \(2,\); got shape \(3,\)",
    ),
    (
        "query_lengths too long",
        lambda: call(query_lengths=[6, 1]),
        AttentionValueError,
        r"query_lengths must be <= 5, the number of query positions "
        r"\(Q \(2, 5, 8\), K \(2, 6, 8\)\); got 6",
    ),
    (
        "query_lengths negative",
        lambda: call(query_lengths=[0, -2]),
        AttentionValueError,
        r"query_lengths must be >= 0; got -2",
    ),
    (
        "query_lengths count",
        lambda: call(query_lengths=[1]),
        ShapeError,
        r"query_lengths must hold one length per sequence, shape \(2,\); got shape \(1,\)",
    ),
    (
        "unknown alignment",
        lambda: call(causal=True, causal_alignment="top-left"),
        AttentionValueError,
        r"causal_alignment must be one of \('bottom_right', 'top_left', "
        r"'bottom_right_per_sequence'\); "
        r"got 'top-left'",
    ),
    (
        "zero scale",
        lambda: call(scale=0),
        AttentionValueError,
        r"scale must be a positive number that float64 can hold; got 0",
    ),
    ("negative scale", lambda: call(scale=-0.5), AttentionValueError, r"got -0.5"),
    ("nan scale", lambda: call(scale=float("nan")), AttentionValueError, r"got nan"),
    ("string scale", lambda: call(scale="1"), AttentionTypeError, r"scale must be a positive"),
    (
        "causal not a bool",
        lambda: call(causal="yes"),
        AttentionTypeError,
        r"causal must be True or False; got 'yes'",
    ),
    ("complex data", lambda: call(Q=Q + 0j), AttentionTypeError, r"Q has dtype complex128"),
    (
        "object data",
        lambda: call(W_k=W[1].astype(object)),
        AttentionTypeError,
        r"W_k has dtype object",
    ),
    (
        "string data",
        lambda: call(V=np.full((2, 6, 8), "a")),
        AttentionTypeError,
        r"V has dtype <U1",
    ),
    ("boolean data", lambda: call(Q=Q > 0), AttentionTypeError, r"Q has boolean dtype"),
    (
        "ragged list",
        lambda: call(Q=[[1.0, 2.0], [3.0]]),
        AttentionTypeError,
        r"Q could not be read as an array",
    ),
    (
        "zero head width",
        lambda: call(W_q=np.zeros((8, 0)), W_k=np.zeros((8, 0))),
        AttentionValueError,
        r"head width d_k is 0 \(W_q \(8, 0\)\).*pass scale=",
    ),
    (
        "sdpa missing head axis",
        lambda: mha.scaled_dot_product_attention(Q[0], K[0], V[0]),
        ShapeError,
        r"q must have shape \(..., H, L, d\) with a head axis; got shape \(5, 8\)",
    ),
    (
        "sdpa head width",
        lambda: mha.scaled_dot_product_attention(q, k[..., :4], v),
        ShapeError,
        r"q has head width 8 but k has 4 \(q \(2, 1, 5, 8\), k \(2, 1, 6, 4\)\)",
    ),
    (
        "sdpa leading axes",
        lambda: mha.scaled_dot_product_attention(q, k[:1], v[:1]),
        ShapeError,
        r"q has batch axes \(2,\) but k has \(1,\) \(q \(2, 1, 5, 8\), k \(1, 1, 6, 8\)\)",
    ),
    (
        "sdpa positions",
        lambda: mha.scaled_dot_product_attention(q, k, v[..., :4, :]),
        ShapeError,
        r"k has 6 positions but v has 4",
    ),
    (
        "module d_model not divisible",
        lambda: mha.MultiHeadAttention(8, 3),
        AttentionValueError,
        r"d_model=8 is not divisible by num_heads=3",
    ),
    (
        "module d_model zero",
        lambda: mha.MultiHeadAttention(0, 1),
        AttentionValueError,
        r"d_model must be a positive integer; got 0",
    ),
    (
        "module d_model negative",
        lambda: mha.MultiHeadAttention(-4, 2),
        AttentionValueError,
        r"d_model must be a positive integer; got -4",
    ),
    (
        "module num_heads zero",
        lambda: mha.MultiHeadAttention(8, 0),
        AttentionValueError,
        r"num_heads must be a positive integer; got 0",
    ),
    (
        "module input width",
        lambda: mha.MultiHeadAttention(6, 2)(Q),
        ShapeError,
        r"query has width 8 but this MultiHeadAttention has d_model=6 \(query \(2, 5, 8\)\)",
    ),
    (
        "module key width",
        lambda: mha.MultiHeadAttention(8, 2, kdim=4)(Q, key=K),
        ShapeError,
        r"key has width 8 but this MultiHeadAttention has kdim=4",
    ),
    (
        "module integer mask",
        lambda: mha.MultiHeadAttention(8, 2)(Q, mask=1),
        AttentionTypeError,
        r"the mask \(forward's second argument, or mask=\) must be None, True/False \(causal\) "
        r"or a boolean array",
    ),
    (
        "module float mask",
        lambda: mha.MultiHeadAttention(8, 2)(Q, mask=np.ones((5, 5))),
        AttentionTypeError,
        r"True = may attend; got an array of dtype float64",
    ),
    (
        "V rank unlike Q",
        lambda: call(V=V[0]),
        ShapeError,
        r"V must have shape \(B, S, d_vin\), like Q \(2, 5, 8\); got shape \(6, 8\)",
    ),
    (
        "query_lengths float",
        lambda: call(query_lengths=np.array([1.5, 2.0])),
        AttentionTypeError,
        r"query_lengths must hold integers; got dtype float64",
    ),
    (
        "key_lengths uint64 beyond S",
        lambda: call(key_lengths=np.array([2**64 - 1, 5], dtype=np.uint64)),
        AttentionValueError,
        r"key_lengths must be <= 6, the number of key positions .*got 18446744073709551615",
    ),
    (
        "huge integer scale",
        lambda: call(scale=10**400),
        AttentionValueError,
        r"scale must be a positive number that float64 can hold",
    ),
    (
        "scale beyond float32",
        lambda: call(*[a.astype(np.float32) for a in (Q, K, V, *W)], scale=1e300),
        AttentionValueError,
        r"scale must be a positive number that float32 can hold; got 1e\+300",
    ),
    (
        "array causal_alignment",
        lambda: call(causal=True, causal_alignment=np.array(["top_left", "x"])),
        AttentionValueError,
        r"causal_alignment must be one of",
    ),
    (
        "return_weights not a bool",
        lambda: call(return_weights="no"),
        AttentionTypeError,
        r"return_weights must be True or False; got 'no'",
    ),
    (
        "workers zero",
        lambda: call(workers=0),
        AttentionValueError,
        r"workers must be a positive integer; got 0",
    ),
    (
        "max_memory float",
        lambda: call(max_memory=1.5e6),
        AttentionTypeError,
        r"max_memory must be a positive integer; got 1500000.0",
    ),
    (
        "module scale type",
        lambda: mha.MultiHeadAttention(8, 2)(Q, scale="big"),
        AttentionTypeError,
        r"scale must be a positive real number; got 'big'",
    ),
    (
        "module rank",
        lambda: mha.MultiHeadAttention(8, 2)(Q[None]),
        ShapeError,
        r"query must have shape \(B, L, d_model\) or \(L, d_model\); got shape \(1, 2, 5, 8\)",
    ),
    (
        "module positional integer mask",
        lambda: mha.MultiHeadAttention(8, 2)(Q, np.tril(np.ones((5, 5), int))),
        AttentionTypeError,
        r"the mask \(forward's second argument.*got an array of dtype int64 and shape \(5, 5\)",
    ),
    (
        "module positional scalar mask",
        lambda: mha.MultiHeadAttention(8, 2)(Q, 1),
        AttentionTypeError,
        r"the mask \(forward's second argument.*got 1\. For cross-attention pass key= "
        r"\(and value=\)",
    ),
    (
        "module seed",
        lambda: mha.MultiHeadAttention(8, 2, seed=-1),
        AttentionTypeError,
        r"seed must be None, a non-negative integer or a np.random.Generator; got -1",
    ),
    (
        "module seed type",
        lambda: mha.MultiHeadAttention(8, 2, seed="a"),
        AttentionTypeError,
        r"seed must be .* got 'a'",
    ),
    (
        "bias_k without bias_v",
        lambda: call(bias_k=np.zeros(8)),
        AttentionValueError,
        r"bias_k and bias_v go together",
    ),
    (
        "bias_k shape",
        lambda: call(bias_k=np.zeros(7), bias_v=np.zeros(8)),
        ShapeError,
        r"bias_k must have shape \(8,\) to match the columns of its weight \(8, 8\)",
    ),
    (
        "add_zero_attn not a bool",
        lambda: call(add_zero_attn=1),
        AttentionTypeError,
        r"add_zero_attn must be True or False",
    ),
    (
        "module dtype",
        lambda: mha.MultiHeadAttention(8, 2, dtype=int),
        AttentionTypeError,
        r"dtype must be a floating dtype",
    ),
    (
        "module bias flag",
        lambda: mha.MultiHeadAttention(8, 2, bias="yes"),
        AttentionTypeError,
        r"bias must be True or False",
    ),
]


@pytest.mark.parametrize(
    ("thunk", "kind", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_error_type_and_message(thunk, kind, message):
    with pytest.raises(kind, match=message) as caught:
        thunk()
    assert isinstance(caught.value, AttentionError)
    assert isinstance(caught.value, (ValueError, TypeError))


def test_the_family_is_catchable_the_usual_way():
    assert issubclass(ShapeError, ValueError) and issubclass(ShapeError, AttentionValueError)
    assert issubclass(AttentionTypeError, TypeError)
    with pytest.raises(ValueError, match="positions"):
        call(V=V[:, :5])


# --------------------------------------------- messages quote what the caller gave

WORDS = {"shape", "batch", "got", "has", "of"}  # English before a parenthesis, not names


def _quoted(message):
    """Every ``name (n, ...)`` a message quotes: the arrays it names, with their shapes."""
    found = re.findall(r"\b([A-Za-z_]\w*) \((\d+(?:, \d+)*,?)\)", message)
    return [(name, tuple(int(n) for n in shape.split(",") if n.strip()))
            for name, shape in found if name not in WORDS]  # fmt: skip


def _module_mistakes():
    """``(what, call, the arrays the caller gave by name)`` through MultiHeadAttention."""
    m = mha.MultiHeadAttention(16, 4, num_kv_heads=2, rope_theta=1e4, seed=0)
    m32 = mha.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0, dtype=np.float32)
    X, memory = r.standard_normal((2, 3, 16)), r.standard_normal((3, 5, 16))
    weights = {name: getattr(m, name) for name in ("W_q", "W_k", "W_v", "W_o")}
    own = {"query": X, "key": X, "value": X, **weights}
    yield "batch", lambda: m(X, key=memory), {**own, "key": memory, "value": memory}
    yield "positions", lambda: m(X, key=memory[:2], value=memory[:2, :4]), {
        **own, "key": memory[:2], "value": memory[:2, :4]}  # fmt: skip
    yield "query_lengths, cached", lambda: m(X, cache=m.new_cache(2), query_lengths=[4, 1]), own
    yield "key_lengths", lambda: m(X, key_lengths=[1, 9]), own
    yield "rotary positions", lambda: m(X, positions=np.arange(4)), own
    unbatched = {**own, "query": X[0], "key": X[0], "value": X[0]}
    yield "positions of heads", lambda: m(X[0], positions=np.zeros((4, 3))), unbatched
    yield "cache batch", lambda: m(X, cache=m.new_cache(3)), own
    yield "cache dtype", lambda: m32(X, cache=m32.new_cache(2)), {**own, **{
        name: getattr(m32, name) for name in weights}}  # fmt: skip
    yield "cache window", lambda: m(X, cache=mha.KVCache(2, 2, 4, window=2)), own
    yield "bias", lambda: m(X, bias=np.zeros((3, 4))), {**own, "bias": np.zeros((3, 4))}
    yield "mask", lambda: m(X, mask=np.ones((2, 3, 4), bool)), {**own, "mask": np.ones((2, 3, 4))}
    yield "constructor rotary_dim", lambda: mha.MultiHeadAttention(4, 1, rope_theta=1.0,
                                                                   rotary_dim=6), {}  # fmt: skip
    yield "constructor odd head", lambda: mha.MultiHeadAttention(6, 2, rope_theta=1.0), {}
    cache = mha.KVCache(2, 2, 4)
    Q3 = r.standard_normal((2, 3, 8))
    Wq, Wkv = r.standard_normal((8, 16)), r.standard_normal((8, 8))
    given = {"Q": Q3, "K": Q3, "V": Q3, "W_q": Wq, "W_k": Wkv, "W_v": Wkv, "W_o": Wq.T}
    yield "function, cached", lambda: mha.multi_head_attention(
        Q3, Q3, Q3, Wq, Wkv, Wkv, Wq.T, 4, num_kv_heads=2, cache=cache, query_lengths=[9, 1],
    ), given  # fmt: skip
    yield "function, positions", lambda: mha.multi_head_attention(
        Q3, Q3, Q3, Wq, Wkv, Wkv, Wq.T, 4, num_kv_heads=2, rope_theta=1.0, positions=[[0, 1]]
    ), given  # fmt: skip


@pytest.mark.parametrize(("what", "thunk", "given"), list(_module_mistakes()),
                         ids=[case[0] for case in _module_mistakes()])  # fmt: skip
def test_messages_quote_the_arguments_as_given(what, thunk, given):
    """A message names arrays only as the caller named them, with the shapes they gave
    (``query (2, 3, 16)`` through the module, never the projected ``q (2, 4, 3, 4)``)."""
    with pytest.raises(AttentionError) as caught:
        thunk()
    message = str(caught.value)
    for name, shape in _quoted(message):
        assert name in given, f"{name} {shape} is not an argument of this call: {message}"
        assert shape == np.shape(given[name]), (
            f"{name} was given {np.shape(given[name])}: {message}"
        )
    assert not re.search(r"\b[qkvx] \(", message), message  # the internal heads and rotary x
