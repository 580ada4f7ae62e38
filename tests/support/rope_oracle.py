"""transformers' rotary embeddings computed in float64 by transformers' own code.

transformers computes its inverse frequencies, angles, cosines and sines in float32 even for
float64 models, which hides every error below 1e-7. :func:`float64_torch` runs torch code in
float64 where it asks for float32: a torch function mode turns ``dtype=torch.float`` and
``torch.float32`` into ``torch.float64`` (in ``arange``, ``tensor``, ``zeros``, ``.to``),
``Tensor.float()`` into ``Tensor.double()``, and the default dtype (which promotes a Python
float times an integer tensor, as the dynamic rope's ``factor * seq_len``) into float64.
Under it, transformers' own ``ROPE_INIT_FUNCTIONS`` and the models' own
``compute_default_rope_parameters`` compute in float64, unchanged.

:func:`float64_rotary` gives a model's rotary embedding modules those float64 frequencies
(checked against the float32 ones they replace at 1e-6, so the mode is shown faithful), keeps
transformers' own ``dynamic_rope_update`` for the stateful ``dynamic`` and ``longrope``
updates (run under the mode), and computes the angles, cosines and sines as the module's
``forward`` does, in float64: each angle for features ``i`` and ``i + r/2`` (Llama's
``cat``), for ``2i`` and ``2i + 1`` (Cohere's ``repeat_interleave``), once (gpt-oss) or as
one complex number of each pair (Llama 4's ``torch.polar``, complex128), over
the rotated width ``r`` of a partial rotary. The new cosines and sines are checked against
those of the module's own ``forward`` at float32 precision, so the layout and the width are
transformers'. The attention's ``apply_rotary_pos_emb`` (which pairs, which features)
is transformers' own code.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

FAITHFUL = 1e-6
"""The largest relative difference allowed between a float64 frequency and the float32 one."""


@contextlib.contextmanager
def float64_torch() -> Iterator[None]:
    """torch code in float64 where it asks for float32 (see the module's docstring)."""
    import torch
    from torch.overrides import TorchFunctionMode

    single = (torch.float32,)

    class Float64(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if kwargs.get("dtype") in single:
                kwargs["dtype"] = torch.float64
            if func is torch.Tensor.float:
                return args[0].double()
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if arg in single else arg for arg in args)
            return func(*args, **kwargs)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64():
            yield
    finally:
        torch.set_default_dtype(previous)


def init_function(rotary: Any, rope_type: str) -> Any:
    """The function a transformers rotary module computes its frequencies with."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type == "default":
        return type(rotary).compute_default_rope_parameters
    return ROPE_INIT_FUNCTIONS[rope_type]


def float64_rotary(model: Any) -> list[Any]:
    """Every rotary embedding module of ``model`` (a model, or a rotary module itself) made
    to compute in float64 with transformers' own code, starting afresh (no sequence seen);
    returns the modules. Raises AssertionError when a float64 frequency is more than
    :data:`FAITHFUL` away from the float32 one it replaces."""
    rotaries = rotary_modules(model)
    if not rotaries:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module")
    for rotary in rotaries:
        if hasattr(rotary, "embed_positions"):
            _sinusoidal_float64(rotary)
        else:
            _make_float64(rotary)
    return rotaries


def rotary_modules(model: Any) -> list[Any]:
    """The rotary embedding modules of ``model`` (a model, or a rotary module itself)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _sinusoidal_float64(rotary: Any) -> None:
    """GPT-J's and CodeGen's table of sines and cosines (``embed_positions``) recomputed in
    float64 by their module's own ``create_sinusoidal_positions``."""
    import sys

    import torch

    create = sys.modules[type(rotary).__module__].create_sinusoidal_positions
    single = rotary.embed_positions
    with float64_torch():
        table = create(rotary.max_positions, rotary.pos_embd_dim)
    error = float((table - single.double()).abs().max())  # float32 angles: |angle| * 2^-24
    if table.dtype != torch.float64 or not error <= FAITHFUL * rotary.max_positions:
        raise AssertionError(f"{type(rotary).__name__}: the float64 table is {error:.2e} away")
    rotary.embed_positions = table


def _layer_types(rotary: Any) -> list[str | None]:
    """``[None]`` for a module of one rope, else its layer types (Gemma 3's sliding and full
    attention layers, each with its own buffers ``{layer_type}_inv_freq``)."""
    return list(rotary.rope_type) if isinstance(rotary.rope_type, dict) else [None]


def _make_float64(rotary: Any) -> None:
    import torch
    from transformers.modeling_rope_utils import dynamic_rope_update

    source = inspect.getsource(type(rotary).forward)  # the undecorated forward (functools.wraps)
    if "torch.cat((freqs, freqs), dim=-1)" in source:
        layout = "halves"  # each angle for feature i and i + r/2
    elif "torch.repeat_interleave(freqs, 2, dim=-1)" in source:
        layout = "pairs"  # Cohere: each angle for features 2i and 2i + 1
    elif "emb = freqs\n" in source:  # gpt-oss: the half-width angles
        layout = "once"
    elif "torch.polar(torch.ones_like(freqs), freqs)" in source:  # Llama 4: complex pairs
        layout = "polar"
    elif "torch.cat((freqs_thw, freqs_thw), dim=-1)" in _recomposition(rotary):
        layout = "sections"  # a multimodal rope's sections, of text positions: the halves'
    else:
        raise NotImplementedError(f"{type(rotary).__name__}.forward: an unknown layout")
    expected = _angles(rotary, rotary.forward, torch.float32)  # before the buffers change
    for layer_type in _layer_types(rotary):
        prefix = "" if layer_type is None else f"{layer_type}_"
        rope_type = rotary.rope_type if layer_type is None else rotary.rope_type[layer_type]
        keywords = {} if layer_type is None else {"layer_type": layer_type}
        config = rotary.config
        if layer_type is not None and "per_layer_config[layer_type]" in inspect.getsource(
            type(rotary).__init__
        ):  # Gemma 4: the config of that layer type (its heads' width)
            config = config.per_layer_config[layer_type]
        with float64_torch():
            inv_freq, attention = init_function(rotary, rope_type)(config, **keywords)
        single = getattr(rotary, f"{prefix}original_inv_freq")
        error = ((inv_freq - single.double()).abs() / single.double().abs().clamp_min(1e-300)).max()
        if inv_freq.dtype != torch.float64 or not error <= FAITHFUL:
            raise AssertionError(
                f"{type(rotary).__name__} {rope_type}: the float64 frequencies ({inv_freq.dtype}) "
                f"are {float(error):.2e} away from transformers' float32 ones"
            )
        scaling_name = "attention_scaling" if layer_type is None else f"{prefix}attention_scaling"
        if abs(attention - getattr(rotary, scaling_name)) > FAITHFUL * abs(attention):
            raise AssertionError(f"{type(rotary).__name__}: another attention scaling in float64")
        rotary.register_buffer(f"{prefix}inv_freq", inv_freq, persistent=False)
        rotary.register_buffer(f"{prefix}original_inv_freq", inv_freq.clone(), persistent=False)
        setattr(rotary, scaling_name, attention)
        for stale in (f"{prefix}long_inv_freq", f"{prefix}max_seq_len_cached"):
            if stale in vars(rotary):
                delattr(rotary, stale)
    if hasattr(rotary, "original_max_seq_len"):  # RecurrentGemma's has none (default rope)
        rotary.max_seq_len_cached = rotary.original_max_seq_len

    # transformers' own update of the dynamic and longrope frequencies, before each forward
    update = dynamic_rope_update(lambda self, x, position_ids, **kwargs: None)

    def forward(x: Any, position_ids: Any, layer_type: str | None = None) -> tuple[Any, Any]:
        with float64_torch():
            update(rotary, x, position_ids, layer_type)
        prefix = "" if layer_type is None else f"{layer_type}_"
        inv_freq = getattr(rotary, f"{prefix}inv_freq")
        scaling = getattr(rotary, "attention_scaling" if layer_type is None else
                          f"{prefix}attention_scaling")  # fmt: skip
        if layout == "sections" and position_ids.ndim == 3:  # one row of positions per axis
            if not bool((position_ids == position_ids[:1]).all()):
                raise NotImplementedError("multimodal positions: the oracle takes text ones")
            position_ids = position_ids[0]
        freqs = position_ids[..., None].double() * inv_freq.double()
        if layout == "polar":  # one complex128 rotation of each pair (2i, 2i + 1)
            return torch.polar(torch.ones_like(freqs), freqs) * scaling
        angles = {
            "halves": lambda: torch.cat((freqs, freqs), dim=-1),
            "sections": lambda: torch.cat((freqs, freqs), dim=-1),
            "pairs": lambda: torch.repeat_interleave(freqs, 2, dim=-1),
            "once": lambda: freqs,
        }[layout]()
        return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)

    got = _angles(rotary, forward, torch.float64)
    for (e, g), layer_type in zip(
        zip(expected, got, strict=True), _layer_types(rotary), strict=True
    ):
        if e.shape != g.shape or not (e.double() - g).abs().max() <= FAITHFUL * CHECKED:
            raise AssertionError(
                f"{type(rotary).__name__} {layer_type}: the float64 cosines and sines "
                f"{tuple(g.shape)} differ from transformers' float32 ones {tuple(e.shape)}"
            )
    rotary.forward = forward


def _recomposition(rotary: Any) -> str:
    """The source of the module's ``recomposition_frequencies`` (a multimodal rope's
    sections, Cohere Compass's), else ``""``."""
    method = getattr(type(rotary), "recomposition_frequencies", None)
    return "" if method is None else inspect.getsource(method)


CHECKED = 16
"""The positions at which the float64 cosines and sines are checked against transformers'
float32 ones: those of every scaled rope's original length, where no dynamic update
changes the frequencies."""


def _angles(rotary: Any, forward: Any, dtype: Any) -> list[Any]:
    """The cosines and sines, side by side, that ``forward`` gives for ``x`` of ``dtype``
    at the first :data:`CHECKED` positions, per layer type: the layout (halves, pairs,
    partial width) and the angles, within :data:`FAITHFUL` of an angle times the position."""
    import torch

    positions, x = torch.arange(CHECKED)[None], torch.zeros(1, dtype=dtype)
    angles = []
    for layer_type in _layer_types(rotary):
        keywords = {} if layer_type is None else {"layer_type": layer_type}
        rotation = forward(x, positions, **keywords)
        if isinstance(rotation, tuple):
            angles.append(torch.cat(rotation, dim=-1))
        else:  # Llama 4's complex rotation: its cosines and sines, side by side
            angles.append(torch.view_as_real(rotation).flatten(-2))
    return angles
