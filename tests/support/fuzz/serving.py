"""The functions over an engine's arrays and the small ones: ``mha.paged_attention``,
``mha.cascade_attention``, ``mha.merge_attention``, ``mha.apply_rotary`` and
``mha.alibi_slopes``, each drawn with every keyword, valid and not, and checked against the
dense reference (docs/serving.md, the docstrings)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mha

from . import dense
from .arrays import chance, data, data_dtypes, drawn_rng, pick, sizes, values
from .keywords import BAD, NOT_FLAGS, NOT_POSITIVE, NOT_REAL, Drawn, kernel
from .known import avoid
from .outcome import Call, expect_array, expect_close
from .rules import as_float64, dtypes, tolerance

widths = pick([1, 2, 3, 4, 8])


def floats_only(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype.kind in "iu" else dtype


def maybe_list(draw: Any, x: np.ndarray) -> Any:
    return x.tolist() if x.size and draw(chance(0.25), label="as a list") else x


@st.composite
def pool(draw: Any, rng: np.random.Generator, dtype: Any) -> dict[str, Any]:
    """A pool of blocks and sequences in it: ``key_cache``, ``value_cache``, a block table
    whose rows name blocks of the pool where a sequence reads them (garbage past that) and
    the lengths."""
    B, H_kv = draw(sizes, label="num_seqs"), draw(pick([1, 1, 2]), label="H_kv")
    count, size = draw(st.integers(1, 8), label="num_blocks"), draw(
        pick([1, 2, 3, 4, 16]), label="block_size")  # fmt: skip
    d_k, d_v, width = draw(widths, label="d_k"), draw(widths, label="d_v"), draw(
        st.integers(0, 4), label="max_blocks")  # fmt: skip
    lengths = rng.integers(0, width * size + 1, B)
    table = rng.integers(0, count, (B, width))
    unread = np.arange(width) >= -(-lengths[:, None] // size)
    table[unread] = rng.choice([-1, count, 999], size=int(unread.sum()))
    keys = draw(data(rng, (count, size, H_kv, d_k), dtype, spread=2.0), label="keys")
    values_ = draw(data(rng, (count, size, H_kv, d_v), dtype), label="values")
    if size == 1 and avoid("broadcast pool of one-row blocks"):
        keys, values_ = (np.ascontiguousarray(x) if 0 in np.shape(x) or not np.asarray(
            x).strides[0] else x for x in (keys, values_))  # fmt: skip
    return {
        "B": B, "H_kv": H_kv, "d_k": d_k, "d_v": d_v, "size": size,
        "key_cache": keys, "value_cache": values_,
        "block_table": maybe_list(draw, table), "seq_lens": maybe_list(draw, lengths),
        "table": table, "lengths": lengths,
    }  # fmt: skip


def gathered(key_cache: Any, value_cache: Any, table: Any, lengths: Any,
             prefix: tuple[Any, int] | None = None) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Each sequence's keys and values ``(B, H_kv, S, d)`` read from the pool (its own
    blocks after the shared ``prefix``, ``(blocks, length)``), zero past its length, and
    its whole length."""
    keys, vals = as_float64(key_cache), as_float64(value_cache)
    size = keys.shape[1]
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    B = lengths.size
    table = np.asarray(table, np.int64).reshape(B, -1) if B else np.zeros((0, 0), np.int64)
    blocks, first = (np.zeros(0, np.int64), 0) if prefix is None else (
        np.asarray(prefix[0], np.int64), int(prefix[1]))  # fmt: skip
    whole = first + lengths
    S = max(int(whole.max(initial=0)), 1)
    padded = [np.zeros((B, pool.shape[2], S, pool.shape[3])) for pool in (keys, vals)]
    for b in range(B):
        where = [(blocks[j // size], j % size) for j in range(first)]
        where += [(table[b, j // size], j % size) for j in range(int(lengths[b]))]
        for n, (block, row) in enumerate(where):
            for out, pool_ in zip(padded, (keys, vals), strict=True):
                out[b, :, n] = pool_[block, row]
    return padded[0], padded[1], whole


def paged_scene(q: Any, keys: np.ndarray, vals: np.ndarray, whole: np.ndarray,
                kw: dict[str, Any]) -> dense.Scene:  # fmt: skip
    """The queries ``(B, L, H, d)`` as each sequence's last ``L`` positions."""
    qa = np.moveaxis(as_float64(q), 2, 1)
    B, _, L, d_k = qa.shape
    S = keys.shape[2]
    i, j = np.arange(L).reshape(1, 1, L, 1), np.arange(S).reshape(1, 1, 1, S)
    at = whole.reshape(B, 1, 1, 1) - L + i
    scale = kw.get("scale")
    return dense.Scene(
        q=qa, k=keys, v=vals, scale=1 / math.sqrt(d_k) if scale is None else float(scale),
        q_pos=at, k_pos=j, q_idx=at, k_idx=j, rows=np.ones((B, 1, L, 1), bool),
        keys=j < whole.reshape(B, 1, 1, 1), causal=bool(kw.get("causal")),
        window=kw.get("window"), softcap=kw.get("softcap"),
        sinks=None if kw.get("sinks") is None else np.asarray(kw["sinks"], np.float64),
    )  # fmt: skip


def check_paged(call: Call, result: Any, prefix: tuple[Any, int] | None = None) -> float:
    """``out (B, L, H, d_v)`` (and ``lse (B, H, L)``) against the dense attention over each
    sequence's keys read from its blocks."""
    if prefix is None:
        q, key_cache, value_cache, table, lengths = call.args
    else:
        q, key_cache, value_cache, blocks, first, table, lengths = call.args
        prefix = (blocks, first)
    kw = call.kwargs
    rdtype, cdtype = dtypes(q, key_cache, value_cache)
    out, lse = result if kw.get("return_lse") else (result, None)
    B, L, H, _ = np.shape(q)
    expect_array("out", out, (B, L, H, np.shape(value_cache)[-1]), rdtype, finite=True)
    keys, vals, whole = gathered(key_cache, value_cache, table, lengths, prefix)
    reference = dense.attend(paged_scene(q, keys, vals, whole, kw))
    error = expect_close("out", out, np.moveaxis(reference.out, 1, 2), tolerance(rdtype, cdtype))
    if lse is not None:
        expect_array("lse", lse, (B, H, L), cdtype, finite=False)
        error = max(error, expect_close("lse", lse, reference.lse, tolerance(cdtype, cdtype)))
    return error


@st.composite
def paged_calls(draw: Any) -> Call:
    """One call of ``paged_attention``."""
    rng = drawn_rng(draw, "seed")
    dtype = draw(data_dtypes, label="dtype")
    p = draw(pool(rng, floats_only(dtype)), label="pool")  # integer pools are codes: refused
    H = p["H_kv"] * draw(pick([1, 2]), label="group")
    L = draw(sizes, label="L")
    q = draw(data(rng, (p["B"], L, H, p["d_k"]), dtype), label="q")
    drawn = Drawn()
    for name, strategy in (("causal", st.booleans()), ("window", st.integers(1, 6)),
                           ("return_lse", st.booleans())):  # fmt: skip
        if draw(chance(0.5), label=f"{name} given"):
            drawn.kwargs[name] = draw(strategy, label=name)
    if draw(chance(0.25), label="softcap given"):
        drawn.kwargs["softcap"] = float(rng.uniform(0.5, 5))
    if draw(chance(0.25), label="sinks given"):
        drawn.kwargs["sinks"] = values(rng, (H,), np.float64, 2.0)
    if draw(chance(0.25), label="scale given"):
        drawn.kwargs["scale"] = float(rng.uniform(0.1, 2))
    drawn.kwargs |= draw(kernel(), label="kernel")
    args = [q, p["key_cache"], p["value_cache"], p["block_table"], p["seq_lens"]]
    spoil = draw(pick(["none"] * 18 + ["keyword", "pool"]), label="spoil")
    if spoil == "keyword":
        names = ["causal", "window", "scale", "softcap", "sinks", "return_lse", "max_memory",
                 "workers"]  # fmt: skip
        name = draw(pick(names), label="bad keyword")
        menu = {"causal": NOT_FLAGS[:-1], "return_lse": NOT_FLAGS[:-1], "window": NOT_POSITIVE,
                "scale": NOT_REAL, "softcap": NOT_REAL, "max_memory": NOT_POSITIVE,
                "workers": NOT_POSITIVE, "sinks": BAD["sinks"](rng, (), H, L, 0)}  # fmt: skip
        drawn.kwargs[name] = draw(pick(menu[name]), label=f"bad {name}")
        drawn.refuse.add(name)
    elif spoil == "pool":
        drawn.refuse |= draw(spoilt_pool(args, p), label="bad pool")
    call = Call("paged_attention", mha.paged_attention, tuple(args), drawn.kwargs,
                frozenset(drawn.refuse) or None)  # fmt: skip
    call.check = lambda result: check_paged(call, result)
    return call


@st.composite
def spoilt_pool(draw: Any, args: list[Any], p: dict[str, Any]) -> set[str]:
    """Spoil one of ``paged_attention``'s arrays in ``args``; the names to refuse."""
    kinds = ["table entry", "too long", "negative", "float table", "integer pool", "ranks",
             "heads", "widths"]  # fmt: skip
    kind = draw(pick(kinds), label="bad pool")
    table, lengths = p["table"].copy(), p["lengths"].copy()
    if kind == "table entry" and lengths.size and lengths.max() > 0:
        b = int(np.argmax(lengths))
        table[b, 0] = draw(pick([-1, np.shape(args[1])[0]]), label="entry")
        args[3] = table
        return {"block_table"}
    if kind == "too long" and lengths.size:
        lengths[0] = table.shape[1] * p["size"] + 1
        args[4] = lengths
        return {"seq_lens"}
    if kind == "negative" and lengths.size:
        lengths[0] = -1
        args[4] = lengths
        return {"seq_lens"}
    if kind == "float table":
        args[3] = table.astype(np.float64) + 0.5
        return {"block_table"} if table.size else set()
    if kind == "integer pool":
        name = draw(pick([1, 2]), label="which pool")
        args[name] = np.asarray(args[name]).astype(np.int8)
        return {"key_cache" if name == 1 else "value_cache"}
    if kind == "ranks":
        args[0] = np.zeros(np.shape(args[0])[1:])
        return {"q"}
    if kind == "heads":  # no key/value heads at all
        args[1], args[2] = (np.zeros((*np.shape(a)[:2], 0, np.shape(a)[3])) for a in args[1:3])
        return {"q", "key_cache"}
    args[2] = np.zeros((*np.shape(args[2])[:2], p["H_kv"] + 1, p["d_v"]))
    return {"key_cache", "value_cache"}


@st.composite
def cascade_calls(draw: Any) -> Call:
    """One call of ``cascade_attention``: a shared prefix in some blocks, then each
    sequence's own."""
    rng = drawn_rng(draw, "seed")
    dtype = draw(data_dtypes, label="dtype")
    p = draw(pool(rng, floats_only(dtype)), label="pool")
    count, size = np.shape(p["key_cache"])[:2]
    H = p["H_kv"] * draw(pick([1, 2]), label="group")
    L = draw(sizes, label="L")
    q = draw(data(rng, (p["B"], L, H, p["d_k"]), dtype), label="q")
    blocks = rng.integers(0, count, draw(st.integers(0, 3), label="prefix blocks"))
    first = draw(st.integers(0, blocks.size * size), label="prefix_len")
    drawn = Drawn()
    if draw(chance(0.5), label="causal"):
        drawn.kwargs["causal"] = True
        if np.any(p["lengths"] < L) and not draw(chance(0.25), label="too short"):
            L = int(p["lengths"].min(initial=L))  # each sequence's own positions hold L
            q = draw(data(rng, (p["B"], L, H, p["d_k"]), dtype), label="q")
        if np.any(p["lengths"] < L):
            drawn.refuse.add("seq_lens")
    for name in ("return_lse", "scale"):
        if draw(chance(0.5), label=f"{name} given"):
            drawn.kwargs[name] = True if name == "return_lse" else float(rng.uniform(0.1, 2))
    drawn.kwargs |= draw(kernel(), label="kernel")
    if draw(chance(0.1), label="spoil"):
        bad = draw(pick(["long", "negative", "block", "rank", "float"]), label="bad")
        if bad == "long":
            first = blocks.size * size + 1
            drawn.refuse |= {"prefix_len", "prefix_blocks"}
        elif bad == "negative":
            first = -1
            drawn.refuse.add("prefix_len")
        elif bad == "block" and first:
            blocks[0] = draw(pick([-1, count]), label="block")
            drawn.refuse.add("prefix_blocks")
        elif bad == "rank":
            blocks = blocks.reshape(1, -1)
            drawn.refuse.add("prefix_blocks")
        elif bad == "float" and blocks.size:
            blocks = blocks + 0.5
            drawn.refuse.add("prefix_blocks")
    args = (q, p["key_cache"], p["value_cache"], maybe_list(draw, blocks), first,
            p["block_table"], p["seq_lens"])  # fmt: skip
    call = Call("cascade_attention", mha.cascade_attention, args, drawn.kwargs,
                frozenset(drawn.refuse) or None)  # fmt: skip
    call.check = lambda result: check_paged(call, result, prefix=(blocks, first))
    return call
