"""What a type checker sees of mha's entry points: checked by mypy (CI's type check, which
reads this folder with the package), never run.

Every ``assert_type`` must hold. Every line marked ``# type: ignore[...]`` must stay an error:
mypy's strict mode reports an ignore that is no longer needed, so a keyword that stops being
checked, or a return type that widens, fails the type check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_type

import numpy as np

import mha

Backward = Callable[[Any], dict[str, np.ndarray]]
Result = np.ndarray | tuple[Any, ...]

x, W, q = np.ones((2, 3, 8)), np.eye(8), np.ones((2, 2, 3, 4))
flag = bool(x.size)  # known only at run time

# multi_head_attention: the output, then the weights and backward, as asked for
assert_type(mha.multi_head_attention(x, x, x, W, W, W, W, 2), np.ndarray)
assert_type(mha.multi_head_attention(x, x, x, W, W, W, W, 2, causal=True), np.ndarray)
assert_type(
    mha.multi_head_attention(x, x, x, W, W, W, W, 2, return_weights=True),
    tuple[np.ndarray, np.ndarray],
)
assert_type(
    mha.multi_head_attention(x, x, x, W, W, W, W, 2, return_backward=True),
    tuple[np.ndarray, Backward],
)
assert_type(
    mha.multi_head_attention(x, x, x, W, W, W, W, 2, return_weights=True, return_backward=True),
    tuple[np.ndarray, np.ndarray, Backward],
)
assert_type(mha.multi_head_attention(x, x, x, W, W, W, W, 2, return_weights=flag), Result)
assert_type(  # NumPy's integers and bools, as the checks take them at run time
    mha.multi_head_attention(x, x, x, W, W, W, W, np.int64(2), causal=np.True_, window=np.int32(3)),
    np.ndarray,
)

# scaled_dot_product_attention: output, weights, log-sum-exp, backward
assert_type(mha.scaled_dot_product_attention(q, q, q), np.ndarray)
assert_type(mha.scaled_dot_product_attention(q, q, q, return_weights=True),
            tuple[np.ndarray, np.ndarray])  # fmt: skip
assert_type(mha.scaled_dot_product_attention(q, q, q, return_lse=True),
            tuple[np.ndarray, np.ndarray])  # fmt: skip
assert_type(mha.scaled_dot_product_attention(q, q, q, return_backward=True),
            tuple[np.ndarray, Backward])  # fmt: skip
assert_type(mha.scaled_dot_product_attention(q, q, q, return_weights=True, return_lse=True),
            tuple[np.ndarray, np.ndarray, np.ndarray])  # fmt: skip
assert_type(
    mha.scaled_dot_product_attention(q, q, q, return_weights=True, return_backward=True),
    tuple[np.ndarray, np.ndarray, Backward],
)
assert_type(mha.scaled_dot_product_attention(q, q, q, return_lse=True, return_backward=True),
            tuple[np.ndarray, np.ndarray, Backward])  # fmt: skip
assert_type(
    mha.scaled_dot_product_attention(
        q, q, q, causal=True, return_weights=True, return_lse=True, return_backward=True
    ),
    tuple[np.ndarray, np.ndarray, np.ndarray, Backward],
)
assert_type(mha.scaled_dot_product_attention(q, q, q, return_lse=flag), Result)

# MultiHeadAttention.forward, and calling the module
attention = mha.MultiHeadAttention(8, 2)
assert_type(attention(x), np.ndarray)
assert_type(attention.forward(x, True), np.ndarray)
assert_type(attention(x, key=x, window=2), np.ndarray)
assert_type(attention(x, mask=True, return_weights=True), tuple[np.ndarray, np.ndarray])
assert_type(attention.forward(x, return_backward=True), tuple[np.ndarray, Backward])
assert_type(attention(x, return_weights=True, return_backward=True),
            tuple[np.ndarray, np.ndarray, Backward])  # fmt: skip
assert_type(attention(x, return_backward=flag), Result)
assert_type(attention(x, return_weights=np.True_), Result)
assert_type(mha.merge_attention([q], [q[..., 0]]), tuple[np.ndarray, np.ndarray])

# Mistakes a type checker catches
mha.multi_head_attention(x, x, x, W, W, W, W, 2, casual=True)  # type: ignore[call-overload]
mha.scaled_dot_product_attention(q, q, q, return_weight=True)  # type: ignore[call-overload]
attention(x, key=x, windows=2)  # type: ignore[call-overload]
plain: np.ndarray = attention(x, return_weights=True)  # type: ignore[assignment]
