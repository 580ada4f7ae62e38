"""A plain-loop reference: one batch entry, one head, one query at a time, in Python floats.

It shares no code with mha: visibility is decided key by key from the configuration, the
softmax is written out with ``math.exp`` and sums use ``math.fsum``. Only for tiny sizes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def visible(config: dict[str, Any], b: int, h: int, i: int, j: int) -> bool:
    """May query ``i`` of batch entry ``b``, head ``h``, attend to key ``j``?"""
    layout, kw = config["layout"], config["kwargs"]
    L, S, _H = layout["L"], layout["S"], layout["H"]
    if kw.get("causal"):
        if kw.get("causal_alignment", "bottom_right") == "top_left":
            if j > i:
                return False
        elif j > i + (S - L):
            return False
    if "key_lengths" in kw and j >= _length(kw["key_lengths"], b):
        return False
    if "query_lengths" in kw and i >= _length(kw["query_lengths"], b):
        return False
    if "mask" in kw and not _lookup(kw["mask"], layout, b, h, i, j):
        return False
    return not ("bias" in kw and _lookup(kw["bias"], layout, b, h, i, j) == -math.inf)


def loop_multi_head_attention(config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(out, weights)`` of multi-head attention, computed with loops over scalars."""
    a, kw, layout = config["arrays"], config["kwargs"], config["layout"]
    unbatched = layout["unbatched"]
    Q, K, V = (a[name][None] if unbatched else a[name] for name in ("Q", "K", "V"))
    H, d_k, d_v = layout["H"], layout["d_k"], layout["d_v"]
    B, L, S = Q.shape[0], Q.shape[1], K.shape[1]
    scale = kw.get("scale", 1.0 / math.sqrt(d_k))
    d_out = a["W_o"].shape[1]
    out = np.zeros((B, L, d_out))
    weights = np.zeros((B, H, L, S))
    for b in range(B):
        q = _project(Q[b], a["W_q"], a.get("b_q"))
        k = _project(K[b], a["W_k"], a.get("b_k"))
        v = _project(V[b], a["W_v"], a.get("b_v"))
        joined = [[0.0] * (H * d_v) for _ in range(L)]
        for h in range(H):
            for i in range(L):
                logits = {}
                for j in range(S):
                    if visible(config, b, h, i, j):
                        dot = math.fsum(q[i][h * d_k + c] * k[j][h * d_k + c] for c in range(d_k))
                        logits[j] = dot * scale + _bias(kw, layout, b, h, i, j)
                if not logits:
                    continue  # no visible key: zero weights, zero output
                top = max(logits.values())
                exps = {j: math.exp(x - top) for j, x in logits.items()}
                total = math.fsum(exps.values())
                for j, e in exps.items():
                    weights[b, h, i, j] = e / total
                for c in range(d_v):
                    joined[i][h * d_v + c] = (
                        math.fsum(e * v[j][h * d_v + c] for j, e in exps.items()) / total
                    )
        out[b] = _project(np.array(joined).reshape(L, H * d_v), a["W_o"], a.get("b_o"))
    if unbatched:
        return out[0], weights[0]
    return out, weights


def _project(x: np.ndarray, W: np.ndarray, bias: np.ndarray | None) -> list[list[float]]:
    rows, cols = x.shape[0], W.shape[1]
    return [
        [
            math.fsum(float(x[r, m]) * float(W[m, c]) for m in range(W.shape[0]))
            + (0.0 if bias is None else float(bias[c]))
            for c in range(cols)
        ]
        for r in range(rows)
    ]


def _bias(kw: dict[str, Any], layout: dict[str, Any], b: int, h: int, i: int, j: int) -> float:
    return float(_lookup(kw["bias"], layout, b, h, i, j)) if "bias" in kw else 0.0


def _length(lengths: Any, b: int) -> int:
    lengths = np.asarray(lengths)
    return int(lengths) if lengths.ndim == 0 else int(lengths[b])


def _lookup(array: np.ndarray, layout: dict[str, Any], b: int, h: int, i: int, j: int) -> Any:
    """The entry of a mask or bias for ``(b, h, i, j)``; a (B, L, S) array has no head axis."""
    if layout["unbatched"]:
        full = np.broadcast_to(array, (layout["H"], layout["L"], layout["S"]))
        return full[h, i, j]
    if array.ndim == 3:
        array = array[:, None]
    full = np.broadcast_to(array, (layout["B"], layout["H"], layout["L"], layout["S"]))
    return full[b, h, i, j]


def loop_log_sum_exp(
    q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray, config: dict[str, Any]
) -> np.ndarray:
    """``log sum_j exp(logit_ij)`` over the visible keys of split heads ``q (B, H, L, d)``,
    ``k (B, H, S, d)``, in Python floats with ``math.fsum``; ``-inf`` where none is visible."""
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    out = np.full((B, H, L), -math.inf)
    for b, h, i in np.ndindex(B, H, L):
        logits = [
            math.fsum(float(x) * float(y) for x, y in zip(q[b, h, i], k[b, h, j], strict=True))
            * scale
            + float(bias[b, h, i, j])
            for j in range(S)
            if visible(config, b, h, i, j)
        ]
        if logits:
            top = max(logits)
            out[b, h, i] = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return out


def paper_slopes(n: int) -> np.ndarray:
    """ALiBi's slopes as the paper's code computes them (ofirpress/attention_with_linear_biases)."""

    def power_of_2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start ** (i + 1) for i in range(m)]

    if math.log2(n).is_integer():
        return np.array(power_of_2(n))
    m = 2 ** math.floor(math.log2(n))
    return np.array(power_of_2(m) + power_of_2(2 * m)[0::2][: n - m])
