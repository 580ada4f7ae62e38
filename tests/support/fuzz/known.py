"""Bugs the fuzzer found that are not fixed yet, each with its reproducer.

While a bug is open, the strategies do not draw what triggers it (``avoid(name)``), so
that the rest of the run still says something; ``tests/test_fuzz.py`` runs each reproducer
as a strict xfail, which fails (XPASS) the day the bug is fixed: then delete its entry
here, and the strategies draw its trigger again. Nothing here weakens a check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest

import mha


def zero_query_heads() -> None:
    """q with no heads over k and v with one (1 divides 0): a ZeroDivisionError in the
    tile planner instead of an empty result (or a refusal naming q)."""
    try:
        out = mha.scaled_dot_product_attention(np.zeros((0, 2, 4)), np.zeros((1, 3, 4)),
                                               np.zeros((1, 3, 4)))  # fmt: skip
    except mha.AttentionError:
        return
    assert out.shape == (0, 2, 4)


def mask_mod_refused_after_dropout_draw() -> None:
    """A mask_mod refused for what it returns is found only once the dropout's seed has
    been drawn: the refused call advances the caller's generator (split_heads.py says "a
    refused call leaves the generator be"; so does multi_head_attention)."""
    generator = np.random.default_rng(0)
    state = repr(generator.bit_generator.state)
    q = np.ones((1, 1, 2, 4))
    with contextlib.suppress(mha.AttentionTypeError):
        mha.scaled_dot_product_attention(
            q,
            q,
            q,
            dropout_p=0.5,
            generator=generator,
            mask_mod=lambda b, h, i, j: (i >= j).astype(int),
        )
    assert repr(generator.bit_generator.state) == state


def mask_false_with_a_window_cache() -> None:
    """``mask=False`` (no causal mask, no array) counts as a mask over positions with a
    cache, so a window's cache refuses it ("mask with cache= index keys by position").
    Since attention that is not causal through a cache (``mask=False``: every key seen), a
    window's cache refuses it by the window."""
    cache = mha.KVCache(1, 1, 2, window=2)
    q = np.ones((1, 1, 1, 2))
    with pytest.raises(mha.AttentionValueError, match=r"mask=False\) with cache=.* window"):
        mha.scaled_dot_product_attention(q, q, q, cache=cache, mask=False)
    assert cache.lengths.tolist() == [0]


def rope_scaling_without_keys() -> None:
    """``multi_head_attention`` with ``rope_scaling`` over no keys (``S = 0``, queries at
    the negative positions ``S - L ..``): the length the scaling reads, ``1 + max(positions)``,
    is 0, and the call is refused as "seq_len must be a positive number; got 0.0", a
    keyword the caller never gave."""
    W = np.ones((4, 4))
    x, none = np.ones((1, 1, 4)), np.ones((1, 0, 4))
    mha.multi_head_attention(x, none, none, W, W, W, W, 2, rope_theta=10000.0,
                             rope_scaling={"rope_type": "linear", "factor": 2.0})  # fmt: skip


def yarn_with_theta_one() -> None:
    """``yarn`` rope scaling with ``theta=1.0`` (a positive base, as the docstring's own
    examples use) divides by ``log(theta) = 0``: a raw ZeroDivisionError."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    with contextlib.suppress(mha.AttentionError):  # a refusal would do; a result too
        mha.apply_rotary(np.ones((2, 4)), [0, 1], theta=1.0, scaling=yarn)


def layer_refused_after_drawing_weights() -> None:
    """``MultiHeadAttention(..., seed=generator)`` checks ``add_bias_kv`` and ``sinks`` only
    after drawing the weights from the caller's generator: the refused call advances it."""
    generator = np.random.default_rng(0)
    state = repr(generator.bit_generator.state)
    for option in ("add_bias_kv", "sinks"):
        with contextlib.suppress(mha.AttentionTypeError):
            mha.MultiHeadAttention(4, 2, seed=generator, **{option: 1})
        assert repr(generator.bit_generator.state) == state, option


def broadcast_pool_of_one_row_blocks() -> None:
    """``paged_attention`` over a pool with blocks of one position whose block axis has
    stride 0 (a broadcast view; the docs take "an engine's arrays in whatever strides they
    have"): the compiled walk reads other rows than the blocks' (a wrong result; the NumPy
    walk, ``MHA_COMPILED=0``, is right): its block axis's stride 0 equalled one row's
    stride of 0, which passed for "the next block follows this one"."""
    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((2, 4, 1, 1, 8))
    q = rng.standard_normal((1, 1, 1, 8))
    broadcast = np.broadcast_to(keys[:1], keys.shape)
    table, lengths = np.array([[0, 1, 2, 3]]), np.array([3])
    out = mha.paged_attention(q, broadcast, values, table, lengths)
    same = mha.paged_attention(q, np.ascontiguousarray(broadcast), values, table, lengths)
    np.testing.assert_allclose(out, same, rtol=1e-13, atol=0)


def rope_scaling_refusal_names_scaling() -> None:
    """``multi_head_attention(..., rope_scaling=...)`` refuses a bad scaling with
    ``apply_rotary``'s name for it: "scaling['rope_type'] 'bogus' is not supported", not
    ``rope_scaling`` (the layer's constructor names it)."""
    W = np.ones((4, 4))
    x = np.ones((1, 2, 4))
    with pytest.raises(mha.AttentionValueError, match="rope_scaling"):
        mha.multi_head_attention(x, x, x, W, W, W, W, 2, rope_theta=10000.0,
                                 rope_scaling={"rope_type": "bogus", "factor": 2.0})  # fmt: skip


def layer_over_a_window_cache_without_window() -> None:
    """``multi_head_attention(..., cache=)`` over a window's ``KVCache`` refuses a call that
    names no window ("window=None but the cache keeps only what window=2 needs"), where
    ``scaled_dot_product_attention`` attends within the cache's window; the function's
    docstring says its cached call is "as in scaled_dot_product_attention"."""
    cache = mha.KVCache(1, 1, 2, window=2)
    X, W = np.ones((1, 1, 2)), np.eye(2)
    mha.multi_head_attention(X, X, X, W, W, W, W, 1, cache=cache)
    assert cache.lengths.tolist() == [1]


OPEN: dict[str, Callable[[], None]] = {}
"""Each open bug: its reproducer, which passes once the bug is fixed."""

FIXED: dict[str, Callable[[], None]] = {
    "broadcast pool of one-row blocks": broadcast_pool_of_one_row_blocks,
    "zero query heads": zero_query_heads,
    "mask_mod refused after dropout's draw": mask_mod_refused_after_dropout_draw,
    "mask=False with a window cache": mask_false_with_a_window_cache,
    "rope scaling without keys": rope_scaling_without_keys,
    "yarn with theta 1": yarn_with_theta_one,
    "layer refused after drawing its weights": layer_refused_after_drawing_weights,
    "rope_scaling refusal names scaling": rope_scaling_refusal_names_scaling,
    "layer over a window cache without window=": layer_over_a_window_cache_without_window,
}
"""Each bug fixed since: its reproducer, run as a test that it stays fixed; the strategies
draw its trigger again."""


def avoid(name: str) -> bool:
    """Whether the strategies must not draw bug ``name``'s trigger (it is still open)."""
    assert name in OPEN or name in FIXED, name
    return name in OPEN
