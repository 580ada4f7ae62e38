"""``mha check``: mha against PyTorch on random configurations, for a user's own machine.

Six checks, each on random configurations, each row with its worst relative error in
float64 and float32 (float32 compared with torch's float64):

* **masks**: the layer with causal masks, key lengths and boolean masks;
* **grouped-query heads**: ``scaled_dot_product_attention`` with fewer key/value heads,
  against ``F.scaled_dot_product_attention(enable_gqa=True)``;
* **rotary positions**: ``apply_rotary`` at random positions, both conventions and partial
  rotation, against the formula written here in torch;
* **windows**: sliding windows with either causal alignment;
* **cached decoding**: a prompt then one token at a time through a KV cache (grouped heads,
  rotary positions, a window), against the whole sequence computed at once by torch;
* **gradients**: every gradient of the layer's backward pass, judged as FlashAttention's
  tests judge theirs: against the exact gradients (written from the chain rule in extended
  precision), mha's error in each dtype at most twice ``torch.autograd``'s own in that dtype
  (plus a floor of a few epsilons of the call's largest gradient, since a gradient that is
  exactly zero leaves torch nothing but its rounding).

The oracle is torch's own computation: its matmuls and ``F.scaled_dot_product_attention``
with a boolean mask built here from ``tril`` and ``arange`` comparisons, never from mha's
mask contract. A query row that sees no key is compared with the contract's answer, a zero
attention output, since torch gives NaN or zeros there depending on the path.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..api.cache import KVCache
from ..api.function import multi_head_attention
from ..api.module import MultiHeadAttention
from ..api.rotary import apply_rotary
from ..api.split_heads import scaled_dot_product_attention
from ._common import TORCH_CPU, count, needs

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}
DTYPES = ("float64", "float32")

Row = dict[str, Any]


def compare(torch: Any, count: int, seed: int) -> Iterator[Row]:
    """``count`` rows per check: the check, the configuration's seed, shape and options,
    and the worst relative error in each dtype, with whether both are within tolerance."""
    for name, check in CHECKS.items():
        tolerance = TOLERANCE
        for index in range(count):
            rng = np.random.default_rng([seed, index, len(name)])
            row = check(torch, rng)
            row.update(check=name, seed=index, tolerance=tolerance)
            if "bounds" in row:  # judged against torch's own error (gradient_row)
                row["ok"] = all(row["bounds"][dtype] <= 1.0 for dtype in DTYPES)
            else:
                row["ok"] = all(row[dtype] <= tolerance[dtype] for dtype in DTYPES)
            yield row


def _masks(torch: Any, rng: np.random.Generator) -> Row:
    B, H = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    L, S, d = int(rng.integers(1, 33)), int(rng.integers(1, 33)), int(rng.integers(1, 17))
    E = H * d
    X, M = rng.standard_normal((B, L, E)), rng.standard_normal((B, S, E))
    W = [rng.standard_normal((E, E)) / math.sqrt(E) for _ in range(4)]
    keywords: dict[str, Any] = {}
    if rng.random() < 0.5:
        keywords["causal"] = True
    if rng.random() < 0.5:
        keywords["key_lengths"] = rng.integers(0, S + 1, size=B)
    if rng.random() < 0.5:
        keywords["mask"] = rng.random((B, L, S)) < 0.8
    allowed = _allowed(torch, B, L, S, causal=keywords.get("causal", False))
    if "key_lengths" in keywords:
        lengths = torch.as_tensor(keywords["key_lengths"])
        allowed = allowed & (torch.arange(S) < lengths[:, None])[:, None, None, :]
    if "mask" in keywords:
        allowed = allowed & torch.from_numpy(keywords["mask"])[:, None]
    expected = _torch_layer(torch, [X, M, M, *W], H, allowed)
    errors = {
        dtype: _error(_layer([X, M, M, *W], dtype, H, keywords), expected) for dtype in DTYPES
    }
    return {
        "shape": _shape(B, H, L, S, d),
        "options": ", ".join(sorted(keywords)) or "none",
        **errors,
    }


def _grouped(torch: Any, rng: np.random.Generator) -> Row:
    B, H_kv, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4])), int(rng.choice([2, 4]))
    H, L, S, d = H_kv * group, int(rng.integers(1, 25)), int(rng.integers(1, 25)), 8
    q = rng.standard_normal((B, H, L, d))
    k, v = rng.standard_normal((2, B, H_kv, S, d))
    causal = bool(rng.random() < 0.5)
    lengths = rng.integers(1, S + 1, size=B)
    allowed = _allowed(torch, B, L, S, causal=causal)
    allowed = allowed & (torch.arange(S) < torch.as_tensor(lengths)[:, None])[:, None, None, :]
    t = [torch.from_numpy(x) for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=allowed, enable_gqa=True)
    expected = torch.where(allowed.any(-1, keepdim=True), out, 0.0).numpy()
    errors = {
        dtype: _error(
            scaled_dot_product_attention(
                *(x.astype(dtype) for x in (q, k, v)), causal=causal, key_lengths=lengths
            ),
            expected,
        )
        for dtype in DTYPES
    }
    options = f"{H} query heads, {_heads(H_kv)}" + (", causal" if causal else "")
    return {"shape": _shape(B, H, L, S, d), "options": options + ", key_lengths", **errors}


def _rotary(torch: Any, rng: np.random.Generator) -> Row:
    B, H, L, d = int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 17)), 16
    r = int(rng.choice([d, d // 2]))
    theta, interleaved = float(rng.choice([1e4, 5e5])), bool(rng.random() < 0.5)
    x = rng.standard_normal((B, H, L, d))
    positions = rng.integers(0, 4000, size=(B, L))
    expected = _torch_rotary(
        torch, torch.from_numpy(x), torch.from_numpy(positions), theta, r, interleaved
    ).numpy()
    errors = {
        dtype: _error(
            apply_rotary(
                x.astype(dtype), positions, theta=theta, rotary_dim=r, interleaved=interleaved
            ),
            expected,
        )
        for dtype in DTYPES
    }
    options = f"theta {theta:g}, rotary_dim {r}, " + ("interleaved" if interleaved else "halves")
    return {"shape": f"({B}, {H}, {L}, -, {d})", "options": options, **errors}


def _windows(torch: Any, rng: np.random.Generator) -> Row:
    B, H = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    L, S, d = int(rng.integers(1, 33)), int(rng.integers(1, 33)), int(rng.integers(1, 9))
    E, window = H * d, int(rng.integers(1, 9))
    X, M = rng.standard_normal((B, L, E)), rng.standard_normal((B, S, E))
    W = [rng.standard_normal((E, E)) / math.sqrt(E) for _ in range(4)]
    causal, top_left = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
    keywords: dict[str, Any] = {"window": window, "causal": causal}
    if top_left:
        keywords["causal_alignment"] = "top_left"
    offset = 0 if top_left else S - L
    i, j = torch.arange(L)[:, None] + offset, torch.arange(S)[None, :]
    allowed = (i - j < window) & ((j <= i) if causal else True)
    expected = _torch_layer(torch, [X, M, M, *W], H, allowed[None, None].expand(B, 1, L, S))
    errors = {
        dtype: _error(_layer([X, M, M, *W], dtype, H, keywords), expected) for dtype in DTYPES
    }
    options = (
        f"window {window}"
        + (", causal" if causal else "")
        + (", top-left" if top_left else ", bottom-right")
    )
    return {"shape": _shape(B, H, L, S, d), "options": options, **errors}


def _cached(torch: Any, rng: np.random.Generator) -> Row:
    B, H_kv, group, d = int(rng.integers(1, 4)), int(rng.choice([1, 2])), 2, 8
    H, T = H_kv * group, int(rng.integers(4, 21))
    prompt = int(rng.integers(1, T))
    window = int(rng.integers(2, 8)) if rng.random() < 0.5 else None
    E = 16
    X = rng.standard_normal((B, T, E))
    shapes = {
        "W_q": (E, H * d),
        "W_k": (E, H_kv * d),
        "W_v": (E, H_kv * d),
        "W_o": (H * d, E),
        "b_q": (H * d,),
        "b_k": (H_kv * d,),
        "b_v": (H_kv * d,),
        "b_o": (E,),
    }
    weights = {name: rng.standard_normal(shape) / 4 for name, shape in shapes.items()}
    expected = _torch_decoder(torch, X, weights, H, H_kv, window, theta=1e4)
    errors = {}
    for dtype in DTYPES:
        x, w = X.astype(dtype), {name: a.astype(dtype) for name, a in weights.items()}
        spans = [(0, prompt)] + [(t, t + 1) for t in range(prompt, T)]  # prompt, then tokens
        if dtype == "float64":  # through the module, and in float32 through the function
            module = MultiHeadAttention(
                E, H, num_kv_heads=H_kv, head_dim=d, bias=True, rope_theta=1e4, window=window
            )
            for name, W in module.parameters().items():
                W[...] = w[name]
            cache = module.new_cache(B, capacity=4)
            outs = [module(x[:, a:b], cache=cache) for a, b in spans]
        else:
            cache = KVCache(B, H_kv, d, capacity=4, dtype=dtype, window=window)
            outs = [
                multi_head_attention(
                    x[:, a:b], x[:, a:b], x[:, a:b], w["W_q"], w["W_k"], w["W_v"], w["W_o"], H,
                    b_q=w["b_q"], b_k=w["b_k"], b_v=w["b_v"], b_o=w["b_o"], num_kv_heads=H_kv,
                    rope_theta=1e4, window=window, cache=cache,
                )
                for a, b in spans
            ]  # fmt: skip
        errors[dtype] = _error(np.concatenate(outs, axis=1), expected)
    options = f"prompt {prompt} + {T - prompt} tokens, {_heads(H_kv)}, rotary" + (
        f", window {window}" if window else ""
    )
    return {"shape": _shape(B, H, T, T, d), "options": options, **errors}


def _gradients(torch: Any, rng: np.random.Generator) -> Row:
    B, H = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    L, d = int(rng.integers(1, 17)), int(rng.integers(1, 9))
    S, E = L + int(rng.integers(0, 9)), H * d
    arrays = {
        "Q": rng.standard_normal((B, L, E)),
        "K": rng.standard_normal((B, S, E)),
        "V": rng.standard_normal((B, S, E)),
    }
    arrays |= {
        name: rng.standard_normal((E, E)) / math.sqrt(E) for name in ("W_q", "W_k", "W_v", "W_o")
    }
    arrays |= {name: rng.standard_normal(E) for name in ("b_q", "b_k", "b_v", "b_o")}
    causal = bool(rng.random() < 0.5)
    lengths = rng.integers(1, S + 1, size=B)  # every row sees a key: torch's rows stay finite
    return gradient_row(torch, arrays, H, causal, lengths, rng.standard_normal((B, L, E)))


GRADIENT_MULTIPLE = 2.0
"""How much larger than torch's own error mha's may be (FlashAttention's tests' factor)."""

GRADIENT_FLOOR = 16.0
"""The smallest error always allowed, in units of the dtype's epsilon times the call's
largest gradient: a gradient that is zero (a row that sees one key has none for its query)
is exact in mha and rounding noise in torch, so torch's own error can be 0."""


def gradient_row(
    torch: Any,
    arrays: dict[str, np.ndarray],
    H: int,
    causal: bool,
    lengths: np.ndarray,
    grad: np.ndarray,
) -> Row:
    """Every gradient of the layer judged against the scale of its computation, as
    FlashAttention's tests judge theirs: the exact gradients (:func:`exact_gradients`, in
    extended precision) are the reference, and mha's error in each dtype may be at most
    ``GRADIENT_MULTIPLE`` times torch's own error in that dtype, plus ``GRADIENT_FLOOR``
    epsilons of the call's largest gradient. The row reports mha's worst error relative to
    that largest gradient; torch in float64 must agree with the exact reference too, which
    checks the reference."""
    B, L, E = arrays["Q"].shape
    S = arrays["K"].shape[1]
    exact = exact_gradients(arrays, H, causal, lengths, grad)
    largest = max(float(np.abs(g).max(initial=0.0)) for g in exact.values()) or 1.0
    allowed = _allowed(torch, B, L, S, causal=causal)
    allowed = allowed & (torch.arange(S) < torch.as_tensor(lengths)[:, None])[:, None, None, :]
    errors, bounds = {}, {}
    for dtype in DTYPES:
        theirs = _torch_gradients(torch, arrays, H, allowed, grad, dtype)
        given = {name: a.astype(dtype) for name, a in arrays.items()}
        _, backward = multi_head_attention(
            given["Q"],
            given["K"],
            given["V"],
            given["W_q"],
            given["W_k"],
            given["W_v"],
            given["W_o"],
            H,
            b_q=given["b_q"],
            b_k=given["b_k"],
            b_v=given["b_v"],
            b_o=given["b_o"],
            causal=causal,
            key_lengths=lengths,
            return_backward=True,
        )
        ours = backward(grad.astype(dtype))
        floor = GRADIENT_FLOOR * float(np.finfo(dtype).eps) * largest
        worst, ratio = 0.0, 0.0
        for name, reference in exact.items():
            error = _distance(ours[name], reference)
            bound = GRADIENT_MULTIPLE * _distance(theirs[name], reference) + floor
            worst, ratio = max(worst, error), max(ratio, error / bound)
        if dtype == "float64":  # the reference itself, against torch's float64
            floor64 = TOLERANCE["float64"] * largest
            if any(_distance(theirs[n], r) > floor64 for n, r in exact.items()):
                ratio = math.inf
        errors[dtype], bounds[dtype] = worst / largest, ratio
    options = "11 gradients" + (", causal" if causal else "") + ", key_lengths, biases"
    return {"shape": _shape(B, H, L, S, E // H), "options": options, **errors, "bounds": bounds}


def exact_gradients(
    arrays: dict[str, np.ndarray], H: int, causal: bool, lengths: np.ndarray, grad: np.ndarray
) -> dict[str, np.ndarray]:
    """The gradients of ``sum(grad * layer(...))`` for every input, weight and bias of the
    layer with biases (causal bottom-right, key padding), written here from the chain rule
    in NumPy's extended precision (80-bit on x86: 11 more bits than float64), so that their
    own rounding is far below either dtype's. Every row must see a key."""
    x = {name: np.asarray(a, np.longdouble) for name, a in arrays.items()}
    G = np.asarray(grad, np.longdouble)
    B, L, E = x["Q"].shape
    S, d = x["K"].shape[1], E // H

    def heads(a: np.ndarray) -> np.ndarray:  # (B, n, H*d) -> (B, H, n, d)
        return a.reshape(B, a.shape[1], H, d).transpose(0, 2, 1, 3)

    def joined(a: np.ndarray) -> np.ndarray:  # (B, H, n, d) -> (B, n, H*d)
        return a.transpose(0, 2, 1, 3).reshape(B, a.shape[2], H * d)

    q, k, v = (
        heads(x[X] @ x[f"W_{w}"] + x[f"b_{w}"]) for X, w in (("Q", "q"), ("K", "k"), ("V", "v"))
    )
    c = 1 / np.sqrt(np.longdouble(d))
    i, j = np.arange(L)[:, None] + (S - L), np.arange(S)[None, :]
    seen = (j < lengths[:, None, None, None]) & ((j <= i) if causal else True)  # (B, 1, L, S)
    s = np.where(seen, q @ k.transpose(0, 1, 3, 2) * c, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = joined(p @ v)
    d_o = heads(G @ x["W_o"].T)
    dp = d_o @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq, dk, dv = (
        joined(a)
        for a in (ds @ k * c, ds.transpose(0, 1, 3, 2) @ q * c, p.transpose(0, 1, 3, 2) @ d_o)
    )
    result = {"W_o": np.einsum("bli,blj->ij", o, G), "b_o": G.sum(axis=(0, 1))}
    for X, w, dy in (("Q", "q", dq), ("K", "k", dk), ("V", "v", dv)):
        result |= {
            f"W_{w}": np.einsum("bli,blj->ij", x[X], dy),
            f"b_{w}": dy.sum(axis=(0, 1)),
            X: dy @ x[f"W_{w}"].T,
        }
    return result


def _torch_gradients(
    torch: Any, arrays: dict[str, np.ndarray], H: int, allowed: Any, grad: np.ndarray, dtype: str
) -> dict[str, np.ndarray]:
    """torch's autograd through :func:`_torch_layer` in ``dtype``, as float64 arrays."""
    t = {name: torch.tensor(a.astype(dtype), requires_grad=True) for name, a in arrays.items()}
    out = _torch_layer(torch, t, H, allowed, numpy=False)
    (out * torch.from_numpy(grad.astype(dtype))).sum().backward()
    return {name: tensor.grad.numpy().astype(np.float64) for name, tensor in t.items()}


def _distance(ours: np.ndarray, reference: np.ndarray) -> float:
    """``max |ours - reference|``, computed in the reference's precision."""
    difference = np.asarray(ours, reference.dtype) - reference
    return float(np.abs(difference).max(initial=0.0))


CHECKS: dict[str, Callable[[Any, np.random.Generator], Row]] = {
    "masks": _masks,
    "grouped-query heads": _grouped,
    "rotary positions": _rotary,
    "windows": _windows,
    "cached decoding": _cached,
    "gradients": _gradients,
}


def _layer(arrays: list[np.ndarray], dtype: str, H: int, keywords: dict[str, Any]) -> Any:
    """mha's layer on ``Q, K, V, W_q, W_k, W_v, W_o`` cast to ``dtype``."""
    Q, K, V, W_q, W_k, W_v, W_o = (a.astype(dtype) for a in arrays)
    return multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, H, **keywords)


# --- torch's side, written from the definitions ------------------------------------------


def _allowed(torch: Any, B: int, L: int, S: int, *, causal: bool) -> Any:
    """``(B, 1, L, S)``: everything, or the bottom-right causal triangle."""
    allowed = torch.ones(B, 1, L, S, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.tril(torch.ones(L, S, dtype=torch.bool), diagonal=S - L)
    return allowed


def _torch_layer(torch: Any, arrays: Any, H: int, allowed: Any, numpy: bool = True) -> Any:
    """Multi-head attention in torch: projections (with biases when given), SDPA under the
    boolean ``allowed (B, 1, L, S)``, zeros for rows that see no key, output projection."""
    if isinstance(arrays, list):
        arrays = dict(zip(("Q", "K", "V", "W_q", "W_k", "W_v", "W_o"), arrays, strict=True))
    t = {n: a if torch.is_tensor(a) else torch.from_numpy(a) for n, a in arrays.items()}
    B, L, _ = t["Q"].shape

    def heads(x: Any, W: str, b: str) -> Any:
        y = x @ t[W] + t.get(b, 0.0)
        return y.reshape(y.shape[0], y.shape[1], H, -1).transpose(1, 2)

    q, k, v = heads(t["Q"], "W_q", "b_q"), heads(t["K"], "W_k", "b_k"), heads(t["V"], "W_v", "b_v")
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    out = torch.where(allowed.any(dim=-1, keepdim=True), out, 0.0)
    joined = out.transpose(1, 2).reshape(B, L, -1) @ t["W_o"] + t.get("b_o", 0.0)
    return joined.detach().numpy() if numpy else joined


def _torch_rotary(
    torch: Any, x: Any, positions: Any, theta: float, r: int, interleaved: bool
) -> Any:
    """Rotary embeddings from their definition: pair ``i`` of ``r`` features turns by
    ``position * theta^(-2i/r)``; pairs are ``(i, i + r/2)`` (rotate_half) or
    ``(2i, 2i + 1)`` (interleaved); features past ``r`` pass through."""
    frequencies = theta ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    angles = positions.to(torch.float64)[:, None, :, None] * frequencies  # (B, 1, L, r/2)
    cos, sin = angles.cos(), angles.sin()
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        turned = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        turned = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([turned, x[..., r:]], dim=-1)


def _torch_decoder(
    torch: Any,
    X: np.ndarray,
    w: dict[str, np.ndarray],
    H: int,
    H_kv: int,
    window: int | None,
    theta: float,
) -> np.ndarray:
    """The whole sequence at once: projections, rotary positions 0..T-1, grouped heads,
    causal attention within the window, output projection."""
    t = {name: torch.from_numpy(a) for name, a in w.items()}
    x = torch.from_numpy(X)
    B, T, _ = x.shape

    def heads(W: str, b: str, n: int) -> Any:
        y = x @ t[W] + t[b]
        return y.reshape(B, T, n, -1).transpose(1, 2)

    positions = torch.arange(T)[None].expand(B, T)
    q, k = heads("W_q", "b_q", H), heads("W_k", "b_k", H_kv)
    d = q.shape[-1]
    q, k = (_torch_rotary(torch, y, positions, theta, d, False) for y in (q, k))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, heads("W_v", "b_v", H_kv), attn_mask=allowed, enable_gqa=True
    )
    result: np.ndarray = (out.transpose(1, 2).reshape(B, T, -1) @ t["W_o"] + t["b_o"]).numpy()
    return result


def _error(ours: np.ndarray, expected: np.ndarray, scale: float | None = None) -> float:
    """``max |ours - expected|``, relative to ``max |expected|`` (or ``scale``)."""
    if scale is None:
        scale = float(np.abs(expected).max(initial=0.0)) or 1.0
    return float(np.abs(np.asarray(ours, np.float64) - expected).max(initial=0.0)) / scale


def _heads(n: int) -> str:
    return f"{n} key/value head{'s' if n > 1 else ''}"


def _shape(B: int, H: int, L: int, S: int, d: int) -> str:
    return f"({B}, {H}, {L}, {S}, {d})"


# ----------------------------------------------------------------------------- the command


def add_parser(commands: Any) -> None:
    """``mha check``'s options, on the subcommand parsers ``commands``."""
    check = commands.add_parser(
        "check",
        help="compare with PyTorch on random configurations",
        description="Runs mha and torch on random configurations of each feature (masks, "
        "grouped-query heads, rotary positions, windows, cached decoding, gradients; float64 "
        "and float32) and prints the worst relative error of each. Needs torch installed.",
    )
    check.add_argument(
        "--configs", type=count(1), default=8, help="configurations per check (default 8)"
    )
    check.add_argument("--seed", type=count(0), default=0, help="seed of the configurations")
    check.set_defaults(command=command)


def command(args: argparse.Namespace) -> int:
    """``mha check``: the table, then one line per check and the total."""
    needs("rich", "rich")
    try:
        import torch
    except ImportError:
        print(
            "mha check: torch is not installed, so there is nothing to compare against. "
            f"Install its CPU build with: {TORCH_CPU}",
            file=sys.stderr,
        )
        return 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mha against torch {torch.__version__}: worst relative error")
    for column in (
        "check",
        "config",
        "shape (B, H, L, S, d)",
        "options",
        "float64",
        "float32",
        "ok",
    ):
        table.add_column(column)
    rows = list(compare(torch, args.configs, args.seed))
    for row in rows:
        table.add_row(
            row["check"],
            str(row["seed"]),
            row["shape"],
            row["options"],
            f"{row['float64']:.1e}",
            f"{row['float32']:.1e}",
            "yes" if row["ok"] else "NO",
        )
    Console().print(table)
    for name in CHECKS:
        mine = [row for row in rows if row["check"] == name]
        limit = mine[0]["tolerance"]
        within = (
            f"within {GRADIENT_MULTIPLE:g}x torch's own error against the exact gradients"
            if "bounds" in mine[0]
            else f"within {limit['float64']:.0e} (float64) and {limit['float32']:.0e} (float32)"
        )
        print(
            f"{name}: {sum(row['ok'] for row in mine)} of {len(mine)} {within}; worst "
            f"{max(row['float64'] for row in mine):.1e} and "
            f"{max(row['float32'] for row in mine):.1e}"
        )
    failures = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failures} of {len(rows)} configurations within tolerance")
    return 1 if failures else 0
