# mypy: disable-error-code="no-any-return,assignment"
"""What a decoder layer computes around its attention, in NumPy: the activations, the
RMSNorms and the MLPs (dense, fused, and the mixtures of experts), each written from its
family's ``modeling_<family>.py`` in transformers 5.24.

RMSNorm computes in float32 whatever the compute dtype, as transformers does.

>>> import numpy as np
>>> float(silu(np.float64(0.0))), llama_norm(np.array([3.0, 4.0]), np.ones(2), None, 0.0).round(4)
(0.0, array([0.8485, 1.1314]))
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .._kernel.team import Team, cores, one_worker_on_blas_threads
from ..errors import AttentionValueError

__all__ = ["ACTIVATIONS", "Tensors", "UnsupportedModelError"]

Function = Callable[[np.ndarray], np.ndarray]


class UnsupportedModelError(AttentionValueError):
    """A model mha cannot compute exactly (or cannot read), named by what it lacks."""


def compute_dtype(dtype: Any) -> np.dtype:
    """A decoder's compute dtype: float32 or float64 (``ValueError`` otherwise)."""
    checked = np.dtype(dtype)
    if checked not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64; got {checked}")
    return checked


# ---------------------------------------------------------------- activations and norms


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))``, as ``(1 + tanh(x / 2)) / 2`` (no overflow)."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``: :func:`sigmoid`'s steps, in place in one new array."""
    if np.ndim(x) == 0:
        return x * sigmoid(x)
    s = np.multiply(x, 0.5)
    np.tanh(s, out=s)
    s += 1.0
    s *= 0.5
    s *= x
    return s


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (transformers' ``gelu_pytorch_tanh``)."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, exactly: ``x * (1 + erf(x / sqrt(2))) / 2`` (``erf`` from SciPy where installed,
    else Python's ``math.erf`` element by element)."""
    return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476))


def _erf(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf  # type: ignore[import-untyped]
    except ImportError:
        return np.asarray(np.vectorize(math.erf, otypes=[x.dtype])(x), x.dtype)
    return np.asarray(erf(x), x.dtype)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


def relu2(x: np.ndarray) -> np.ndarray:
    """``relu(x) ** 2`` (Primer's squared ReLU)."""
    return np.square(np.maximum(x, 0))


ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu_fast": lambda x: 0.5 * x * (1.0 + np.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "bloom_gelu": lambda x: x * 0.5 * (1.0 + np.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x))),
    "relu": relu,
    "relu2": relu2,
}
"""By transformers' names (``ACT2FN``): ``gelu_new`` is GELU's tanh approximation written
out, the same function; ``gelu_fast`` the same with its constant rounded."""


def _normalise(x: np.ndarray, eps: float) -> np.ndarray:
    """``x / rms(x)`` in float32, as every transformers RMSNorm computes it (the mean as
    ``np.mean`` takes it, the sum over the count, without its wrapper's microseconds)."""
    x = x.astype(np.float32, copy=False)
    mean = np.add.reduce(np.square(x), axis=-1, keepdims=True) / x.shape[-1]
    return x * (1.0 / np.sqrt(mean + eps))


def llama_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """Llama's RMSNorm: cast back to ``x``'s dtype, then times the weight."""
    return weight * _normalise(x, eps).astype(x.dtype, copy=False)


def olmo2_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """OLMo 2's (and gpt-oss's): times the weight, then cast back."""
    return (weight * _normalise(x, eps)).astype(x.dtype)


def gemma_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """Gemma's: times ``1 + weight`` in float32 (its weights start at zero), then cast back."""
    return (_normalise(x, eps) * (1.0 + weight.astype(np.float32))).astype(x.dtype)


def scaled_rms_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """Gemma 3n's and Gemma 4's: times the weight as it is (not ``1 + weight``), in
    float32, then cast back."""
    return (_normalise(x, eps) * weight.astype(np.float32)).astype(x.dtype)


def layer_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """``nn.LayerNorm`` in ``x``'s dtype: ``(x - mean) / sqrt(var + eps)``, times the
    weight plus the bias where the norm has them."""
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt(np.mean(np.square(centred), axis=-1, keepdims=True) + x.dtype.type(eps))
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def float32_layer_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """A LayerNorm in float32 whatever the compute dtype, then cast back: OLMo's (without
    weights), Cohere's (a weight, no bias)."""
    y = layer_norm(x.astype(np.float32), None, None, eps)
    return (y if weight is None else y * weight.astype(np.float32)).astype(x.dtype)


def layer_norm_1p(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """Nemotron's ``LayerNorm1P``: a LayerNorm times ``1 + weight``, plus the bias."""
    return layer_norm(x, weight + x.dtype.type(1.0), bias, eps)


def weightless_rms_norm(x: np.ndarray, weight: Any, bias: Any, eps: float) -> np.ndarray:
    """NanoChat's RMSNorm without weights: in float32, cast back."""
    return _normalise(x, eps).astype(x.dtype)


class Norm(NamedTuple):
    """A kind of norm: its function ``(x, weight, bias, eps)``, whether it has a weight and
    whether it may have a bias (read where the checkpoint holds one)."""

    function: Callable[[np.ndarray, Any, Any, float], np.ndarray]
    weight: bool = True
    bias: bool = False


NORMS = {
    "llama": Norm(llama_norm),
    "olmo2": Norm(olmo2_norm),
    "gemma": Norm(gemma_norm),
    "gemma4": Norm(scaled_rms_norm),
    "layer": Norm(layer_norm, bias=True),
    "float32_layer": Norm(float32_layer_norm),
    "float32_layer_without_weights": Norm(float32_layer_norm, weight=False),
    "layer_1p": Norm(layer_norm_1p, bias=True),
    "rms_without_weights": Norm(weightless_rms_norm, weight=False),
}
"""The norms of the families, by the name a family's row gives."""


# ---------------------------------------------------------------- MLPs


class Tensors:
    """One layer's tensors by their names under the layer's prefix; each MLP takes its own,
    and what no one takes is refused (a tensor mha would not compute)."""

    def __init__(self, prefix: str, arrays: dict[str, np.ndarray]) -> None:
        self.prefix, self.arrays = prefix, dict(arrays)

    def take(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise UnsupportedModelError(f"the checkpoint has no {self.prefix}{name}")
        return self.arrays.pop(name)

    def get(self, name: str) -> np.ndarray | None:
        return self.arrays.pop(name, None)

    def check_all_taken(self) -> None:
        if self.arrays:
            names = ", ".join(self.prefix + name for name in sorted(self.arrays))
            raise UnsupportedModelError(f"mha does not compute {names}")


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def inputs_first(weight: np.ndarray) -> np.ndarray:
    """An ``nn.Linear`` weight ``(out, in)`` as the ``(in, out)`` matrix ``x @ W`` reads,
    laid out row by row: a product of a few rows reads it in order (measured on SmolLM2's
    MLP, 576 by 1,536 in float32, one token: 37 ms a step's 90 products against 31, one
    thread; 37 tokens: 1.05 ms a product against 0.75, two threads)."""
    return np.ascontiguousarray(weight.T)


_RUNNING = threading.local()  # each thread's pass: its team (or none), its attention's workers


TEAM_FROM = 464
"""The fewest tokens in a pass that runs on one team (:func:`one_team`)."""


@contextlib.contextmanager
def one_team(tokens: int) -> Iterator[Team | None]:
    """How a model's pass of ``tokens`` tokens runs. From :data:`TEAM_FROM` tokens on, on a
    team of every core: its matrix products (:func:`product`) and its attention layers' on
    the team's threads, BLAS held to one thread throughout; not BLAS's own threads for some
    products and mha's for others, which on 2 cores wait spinning after each product and
    take a core from mha's (a layer's attention call of 512 tokens: 10.5 ms, 16.7 right
    after a multi-threaded GEMM). Below, every product on BLAS's threads, whose products of
    a few rows beat the team's split by columns, the attention layers' projections too
    (:func:`~mha._kernel.team.one_worker_on_blas_threads`: a 37-token prompt's 60
    projections took 41 ms on one thread), and their attention on one worker
    (:func:`attention_workers`), whose helper would wait for a core. SmolLM2's pass to the
    last position's logits, interleaved medians in one process (AMD EPYC, 2 cores), on
    BLAS's threads over on one team: 64 tokens 0.95, 128: 0.93, 256: 0.88, 384: 0.92, 448:
    0.91 and 0.96, 480: 1.11, 512: 1.21 and 1.05, 640: 1.27. Before the projections ran on
    BLAS's threads, 37 tokens took 129 ms on BLAS's threads against 142 on one team, 128:
    283 against 281."""
    outer = getattr(_RUNNING, "team", None), getattr(_RUNNING, "workers", None)
    try:
        if tokens < TEAM_FROM:
            _RUNNING.team, _RUNNING.workers = None, 1
            with one_worker_on_blas_threads():
                yield None
            return
        with Team(cores()) as team:
            _RUNNING.team, _RUNNING.workers = team, None
            yield team
    finally:
        _RUNNING.team, _RUNNING.workers = outer


def attention_workers() -> int | None:
    """The workers of the attention layers' calls in this thread's pass (``None``: their
    own choice; 1 in a pass on BLAS's threads, :func:`one_team`)."""
    workers: int | None = getattr(_RUNNING, "workers", None)
    return workers


def product(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """``x @ W``, on the pass's team (:func:`one_team`) where there is one."""
    team = getattr(_RUNNING, "team", None)
    return x @ W if team is None else team.matmul(x, W)


def by_rows(function: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``function(x)`` for a ``function`` of each row of ``x (..., n)`` alone (a norm), on
    the pass's team where there is one: each worker takes a block of rows (the same bits;
    a 512-token pass's 61 norms on the main thread alone took 2.4% of it)."""
    team = getattr(_RUNNING, "team", None)
    if team is None:
        return function(x)
    rows = x.reshape(-1, x.shape[-1])
    first = function(rows[:0])  # its dtype and width
    out = np.empty((rows.shape[0], first.shape[-1]), first.dtype)
    step = max(1, -(-rows.shape[0] // team.workers))
    spans = [slice(i, i + step) for i in range(0, rows.shape[0], step)]

    def make_worker() -> Callable[[slice], None]:
        def work(span: slice) -> None:
            out[span] = function(rows[span])

        return work

    team.run(spans, make_worker)
    return out.reshape((*x.shape[:-1], out.shape[-1]))


def gated_product(
    x: np.ndarray, W: np.ndarray, b: np.ndarray | None, act: Function, width: int
) -> np.ndarray:
    """``act(gate) * up`` of ``x @ W (+ b)`` (its first ``width`` columns the gate's, the
    rest the up projection's), on the pass's team where there is one: each worker gates the
    block of rows it made while the block is in cache (an elementwise step: the same bits
    as on the whole product)."""
    product_dtype = np.result_type(x, W)
    gated = np.empty((*x.shape[:-1], width), product_dtype)
    rows = gated.reshape(-1, width)

    def gate(span: slice, block: np.ndarray) -> None:
        g = act(block[:, :width])  # a new array
        g *= block[:, width:]
        rows[span] = g

    team = getattr(_RUNNING, "team", None)
    if team is not None:
        team.matmul(x, W, b, then=gate)
        return gated
    products = x @ W
    if b is not None:
        products += b
    gate(slice(None), products.reshape(-1, W.shape[1]))
    return gated


def linear(tensors: Tensors, name: str, transposed: bool = False) -> Function:
    """``nn.Linear`` ``name``: ``x @ weight.T + bias``, the bias where the checkpoint has one
    (``transposed``: a ``Conv1D``'s ``x @ weight + bias``)."""
    weight, bias = tensors.take(f"{name}.weight"), tensors.get(f"{name}.bias")
    weight = weight if transposed else inputs_first(weight)
    return lambda x: product(x, weight) if bias is None else product(x, weight) + bias


def gated_mlp(
    tensors: Tensors, act: Function, prefix: str = "mlp.", names: tuple[str, ...] = GATE_UP_DOWN
) -> Function:
    """Llama's SwiGLU (Gemma's GELU): ``down(act(gate(h)) * up(h))``, its projections named
    ``names`` under ``prefix``; the gate's and the up projection's weights (and biases,
    where the checkpoint has them) side by side in one matrix, which one product reads."""
    gate_name, up_name, down_name = (f"{prefix}{name}" for name in names)
    both = [tensors.take(f"{name}.weight") for name in (gate_name, up_name)]
    biases = [tensors.get(f"{name}.bias") for name in (gate_name, up_name)]
    width = len(both[0])
    gate_up = inputs_first(np.concatenate(both))  # (in, 2 * intermediate)
    bias = None
    if biases[0] is not None or biases[1] is not None:
        bias = np.concatenate([np.zeros(len(W), W.dtype) if b is None else b
                               for b, W in zip(biases, both, strict=True)])  # fmt: skip
    del both
    down = linear(tensors, down_name)

    def mlp(h: np.ndarray) -> np.ndarray:
        return down(gated_product(h, gate_up, bias, act, width))

    return mlp


def plain_mlp(
    tensors: Tensors, act: Function, names: tuple[str, ...], transposed: bool = False
) -> Function:
    """GPT-2's MLP: ``down(act(up(h)))``, its two projections named ``names``; ``transposed``
    where they are ``Conv1D``s, whose weights are stored ``(in, out)``."""
    up, down = (linear(tensors, name, transposed) for name in names)
    return lambda h: down(act(up(h)))


def fused_mlp(
    tensors: Tensors, act: Function, names: tuple[str, ...] = ("mlp.gate_up_proj", "mlp.down_proj")
) -> Function:
    """Phi-3's: one ``gate_up_proj``, the gate its first half (ModernBERT's ``Wi``, ``Wo``)."""
    gate_up, down = (linear(tensors, name) for name in names)

    def mlp(h: np.ndarray) -> np.ndarray:
        gate, up = np.split(gate_up(h), 2, axis=-1)
        return down(act(gate) * up)

    return mlp


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest scores of each row, largest first (``torch.topk``)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def mixture(experts: list[Function], h: np.ndarray, chosen: np.ndarray, weights: Any) -> Any:
    """``sum_k weights[t, k] * experts[chosen[t, k]](h[t])`` for each token ``t`` of
    ``h (N, D)``, expert by expert, as transformers' eager experts add them up."""
    out = np.zeros_like(h)
    for e, expert in enumerate(experts):
        rows, slots = np.nonzero(chosen == e)  # each token picks an expert once at most
        if rows.size:
            out[rows] += expert(h[rows]) * weights[rows, slots, None]
    return out


def gpt_oss_mlp(tensors: Tensors, config: dict[str, Any]) -> Function:
    """gpt-oss's mixture: a softmax over the ``num_experts_per_tok`` largest router logits;
    experts ``(E, D, 2I)`` in the ``x @ W`` layout, gate and up interleaved, clamped to
    ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    router = linear(tensors, "mlp.router")
    W_gate_up, b_gate_up = (tensors.take(f"mlp.experts.gate_up_proj{s}") for s in ("", "_bias"))
    W_down, b_down = (tensors.take(f"mlp.experts.down_proj{s}") for s in ("", "_bias"))
    k, alpha = int(config["num_experts_per_tok"]), float(config["swiglu_alpha"])
    limit = float(config["swiglu_limit"])

    def expert(e: int) -> Function:
        def run(x: np.ndarray) -> np.ndarray:
            gate_up = x @ W_gate_up[e] + b_gate_up[e]
            gate = np.minimum(gate_up[..., ::2], limit)
            up = np.clip(gate_up[..., 1::2], -limit, limit)
            return ((up + 1.0) * (gate * sigmoid(gate * alpha))) @ W_down[e] + b_down[e]

        return run

    experts = [expert(e) for e in range(len(W_gate_up))]

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        logits = router(x)
        chosen = top_k(logits, k)
        top = np.take_along_axis(logits, chosen, axis=-1)
        weights = np.exp(top - top[:, :1])
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return np.asarray(mixture(experts, x, chosen, weights).reshape(h.shape))

    return mlp


def softmax_experts(
    tensors: Tensors, config: dict[str, Any], act: Function, layer: int, family: Any
) -> Function:
    """Mixtral's, Qwen3-MoE's and OLMoE's mixtures: in float32, a softmax over the router's
    logits, the ``num_experts_per_tok`` best experts weighted by their probabilities
    (renormalised where ``norm_topk_prob``, always in Mixtral), each a SwiGLU. Qwen3-MoE's
    layers in ``mlp_only_layers``, or off its ``decoder_sparse_step``, are dense."""
    prefix, names = family.experts
    sparse = layer not in (config.get("mlp_only_layers") or []) and (
        (layer + 1) % int(config.get("decoder_sparse_step") or 1) == 0
    )
    if not sparse:
        return gated_mlp(tensors, act)
    router = tensors.take(f"{prefix}gate.weight")
    k, normalise = int(config["num_experts_per_tok"]), family.normalise or config["norm_topk_prob"]
    experts = [gated_mlp(tensors, act, f"{prefix}experts.{e}.", names) for e in range(len(router))]

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        logits = (x @ router.T).astype(np.float32)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        chosen = top_k(probs, k)
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if normalise:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return np.asarray(mixture(experts, x, chosen, weights.astype(x.dtype)).reshape(h.shape))

    return mlp


def deepseek_mlp(tensors: Tensors, config: dict[str, Any], act: Function, layer: int) -> Function:
    """DeepSeek-V3's: a dense MLP in the first ``first_k_dense_replace`` layers; then, in
    float32, sigmoid scores plus ``e_score_correction_bias`` choose the ``topk_group``
    groups of experts with the largest two-best sums and the ``num_experts_per_tok`` best
    experts in them, weighted by their scores (normalised with ``norm_topk_prob``) times
    ``routed_scaling_factor``; a shared expert is added to the mixture."""
    if layer < int(config.get("first_k_dense_replace") or 0):
        return gated_mlp(tensors, act)
    router = tensors.take("mlp.gate.weight").astype(np.float32)
    bias = tensors.take("mlp.gate.e_score_correction_bias").astype(np.float32)
    E, groups = len(router), int(config["n_group"])
    k, k_groups = int(config["num_experts_per_tok"]), int(config["topk_group"])
    scaling, normalise = float(config["routed_scaling_factor"]), config["norm_topk_prob"]
    experts = [gated_mlp(tensors, act, f"mlp.experts.{e}.") for e in range(E)]
    shared = gated_mlp(tensors, act, "mlp.shared_experts.")

    def mlp(h: np.ndarray) -> np.ndarray:
        x = h.reshape(-1, h.shape[-1])
        scores = sigmoid(x.astype(np.float32) @ router.T)  # (N, E)
        choice = (scores + bias).reshape(len(x), groups, E // groups)
        best_two = np.sort(choice, axis=-1)[..., -2:].sum(axis=-1)  # (N, groups)
        kept = np.zeros(best_two.shape, dtype=bool)
        np.put_along_axis(kept, top_k(best_two, k_groups), True, axis=-1)
        choice = np.where(kept[..., None], choice, -np.inf).reshape(len(x), E)
        chosen = top_k(choice, k)
        weights = np.take_along_axis(scores, chosen, axis=-1)
        if normalise:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        mixed = mixture(experts, x, chosen, weights * scaling)
        return np.asarray(mixed.reshape(h.shape) + shared(h))

    return mlp


# ---------------------------------------------------------------- sinusoidal positions, xIELU


def sinusoidal_positions(rows: np.ndarray, width: int, padding: int | None) -> np.ndarray:
    """XGLM's (fairseq's) sinusoidal positions of table rows ``rows``, ``(*rows.shape,
    width)`` in float32: ``sin(row * f_k)`` then ``cos(row * f_k)`` for the ``width // 2``
    frequencies ``f_k = exp(-k * log(10000) / (width // 2 - 1))``, a zero feature last
    where ``width`` is odd, and row ``padding`` all zeros.

    transformers computes the table in float32 and casts it to the compute dtype; the
    products here are its float32 products, and each ``exp``, ``sin`` and ``cos`` is the
    float32 nearest the exact value (torch's float32 functions are within one unit in the
    last place of it).

    >>> sinusoidal_positions(np.array([0, 2]), 4, padding=0).round(3)
    array([[ 0.   ,  0.   ,  0.   ,  0.   ],
           [ 0.909,  0.   , -0.416,  1.   ]], dtype=float32)
    """
    half = width // 2
    step = np.float32(-math.log(10000) / (half - 1))
    frequencies = _rounded(np.exp, np.arange(half, dtype=np.float32) * step)
    angles = rows.astype(np.float32)[..., None] * frequencies
    table = [_rounded(np.sin, angles), _rounded(np.cos, angles)]
    if width % 2:
        table.append(np.zeros((*rows.shape, 1), np.float32))
    out = np.concatenate(table, axis=-1)
    if padding is not None:
        out[rows == padding] = 0.0
    return out


def ctrl_positions(rows: np.ndarray, width: int) -> np.ndarray:
    """CTRL's sinusoidal positions of rows ``rows``, ``(*rows.shape, width)`` in float32:
    feature ``i``'s angle ``row / 10000 ** (2 * (i // 2) / width)``, the sines of the even
    features' angles, then the cosines of the odd ones' (float32 as
    :func:`sinusoidal_positions`)."""
    i = np.arange(width, dtype=np.float32)
    exponents = (np.float32(2.0) * (i // np.float32(2.0))) / np.float32(width)
    rates = np.float32(1.0) / _rounded(lambda e: np.power(10000.0, e), exponents)
    angles = rows.astype(np.float32)[..., None] * rates
    return np.concatenate(
        [_rounded(np.sin, angles[..., 0::2]), _rounded(np.cos, angles[..., 1::2])], axis=-1
    )


def _rounded(function: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``function(x)`` of float32 ``x`` rounded to float32 from float64."""
    return np.asarray(function(x.astype(np.float64)), np.float32)


def xielu(tensors: Tensors, prefix: str) -> Function:
    """Apertus's xIELU, its weights under ``prefix``: ``alpha_p * x * x + beta * x`` for
    ``x > 0``, else ``(expm1(min(x, eps)) - x) * alpha_n + beta * x``, with ``alpha_p =
    softplus(p)`` and ``alpha_n = beta + softplus(n)`` of the learned ``p``, ``n``, and
    ``beta``, ``eps`` the checkpoint's."""
    names = ("alpha_p", "alpha_n", "beta", "eps")
    p, n, beta, eps = (tensors.take(f"{prefix}{name}") for name in names)
    alpha_p, alpha_n = softplus(p), beta + softplus(n)

    def act(x: np.ndarray) -> np.ndarray:
        positive = alpha_p * x * x + beta * x
        negative = (np.expm1(np.minimum(x, eps)) - x) * alpha_n + beta * x
        return np.where(x > 0, positive, negative)

    return act


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``, ``x`` itself above 20 (torch's ``softplus``)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


LEARNED_ACTIVATIONS = {"xielu": xielu}
"""Activations with weights of their own in each layer, by transformers' names: each built
from the layer's tensors under the family's ``act_fn``."""
