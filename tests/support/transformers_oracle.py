"""Hugging Face transformers as the oracle for decoder attention: tiny random models in
float64, their attention layers' inputs and outputs recorded call by call.

transformers computes rotary angles in float32 even for float64 models, which would hide
every error below 1e-7; the models here get a float64 rotary embedding written from
transformers' own formula (``inv_freq = 1 / theta^(2i/d)``, ``cat(freqs, freqs)``), while
everything else (``rotate_half``, ``repeat_kv``, the masks, the caches and their sliding
windows) is transformers' code.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np


def tiny_model(kind: str, seed: int, **overrides: Any) -> Any:
    """A random ``{kind}ForCausalLM`` (llama, mistral or qwen2) in float64 with the SDPA
    attention (the eager one computes its softmax in float32, even for float64 models)."""
    import torch
    import transformers

    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[kind]
    settings = {
        "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 61,
        "max_position_embeddings": 256, "initializer_range": 0.3,
        "attn_implementation": "sdpa",
    }  # fmt: skip
    settings.update(overrides)
    config = config_class(**settings)
    torch.manual_seed(seed)
    model_class = getattr(transformers, f"{config_class.__name__[:-6]}ForCausalLM")
    model = model_class(config).double().eval()
    if kind == "qwen2":  # Qwen2's q/k/v biases start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    _float64_rotary(model)
    return model


def _float64_rotary(model: Any) -> None:
    import torch

    rotary = model.model.rotary_emb
    config = model.config
    theta = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def forward(x: Any, position_ids: Any) -> tuple[Any, Any]:
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = forward


def attention_settings(model: Any) -> dict[str, Any]:
    """``MultiHeadAttention.from_llama``'s keywords for this model's layers."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    return {
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None),
        "rope_theta": config.rope_parameters["rope_theta"],
        "window": window,
    }


def recorder(
    module: Any, calls: list[tuple[np.ndarray, np.ndarray]], slot: int | None = None
) -> Any:
    """A forward hook (``with_kwargs``) of the attention ``module`` that appends each call's
    input and output to ``calls``, as NumPy: without the residual a module adds to its output
    (BLOOM's, given ``residual``), with the output bias one returns apart
    (GPT-NeoX-Japanese's). A module that runs once a cycle (HRM's, given ``cycle_offset``)
    or a loop (Dory's, given ``cache_offset``) is recorded in its cache slot ``slot`` alone
    (``layer_idx`` plus the offset)."""
    parameters = inspect.signature(module.forward).parameters

    def record(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        offset = kwargs.get("cycle_offset", kwargs.get("cache_offset"))
        if slot is not None and offset is not None and module.layer_idx + offset != slot:
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        parts = output if isinstance(output, (tuple, list)) else (output,)  # GPT-1's: a list
        out = parts[0]
        bias = parts[2] if len(parts) > 2 else None  # GLM-MoE-DSA's third: its top-k indices
        if hasattr(bias, "is_floating_point") and bias.is_floating_point():  # output bias apart
            out = out + bias
        if "residual" in parameters:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
            out = out - bound.arguments["residual"]
        calls.append((hidden.detach().numpy().copy(), out.detach().numpy().copy()))

    return record


ATTENTION_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "hybrid",
    "indexed_attention",
    "minimax_m3_sparse",
)
"""transformers' layer types whose layer has an attention module (``chunked_attention``:
Llama 4's; ``hybrid``: Falcon-H1's, beside a Mamba mixer; ``indexed_attention``: sparse
top-k attention's; ``minimax_m3_sparse``: MiniMax-M3's block-sparse attention); the others
(``linear_attention``: Mamba or linear attention, ``conv``, ``moe``, ``mlp``) have none that
mha reads."""


def cache_slots(config: Any) -> int:
    """The cache slots of a model's layers: ``num_hidden_layers``, and the copies of Dory's
    recurrent layers that its later loops run in (``n_recurrent_loops - 1`` of them)."""
    loops = getattr(config, "n_recurrent_loops", 1)
    return int(config.num_hidden_layers) + (loops - 1) * (
        getattr(config, "n_recurrent_layers", 0) or 0
    )


def attention_layers(model: Any) -> list[int]:
    """The layers of ``model`` with an attention module, by transformers' own
    ``config.layer_types`` (every layer where the config has none), by cache slot (Dory's
    later loops after the model's layers, :func:`cache_slots`)."""
    config = model.config
    types = getattr(config, "layer_types", None)
    if types is None:
        return list(range(cache_slots(config)))
    later: list[int] = []  # a looped layer's later runs (Dory's)
    if getattr(config, "n_recurrent_loops", None) is not None:
        later = list(range(int(config.num_hidden_layers), cache_slots(config)))
    return [i for i, kind in enumerate(types) if kind in ATTENTION_TYPES] + later


class AttentionRecorder:
    """Records every call of each attention layer's attention (:func:`attention_layers`:
    every layer but a hybrid model's Mamba, linear-attention or convolution layers): its
    input and its output, as NumPy, in ``calls``, one list per layer of ``layers``. The
    attention of layer ``i`` is the module at ``path`` (``{i}`` its index; with ``{j}``,
    LongCat-Flash's two per decoder layer: the readers' ``module_path``); a module that
    adds the residual to its output (BLOOM's, given ``residual``) is recorded without it,
    one that returns its output bias apart (GPT-NeoX-Japanese's) with it."""

    def __init__(self, model: Any, path: str = "model.layers.{i}.self_attn") -> None:
        from mha.integrations.readers.layouts import module_path

        self.layers = attention_layers(model)
        config = model.config.to_dict()
        modules = [model.get_submodule(module_path(path, i, config)) for i in self.layers]
        self.calls: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in modules]
        self._handles = [
            module.register_forward_hook(self._hook(i, module), with_kwargs=True)
            for i, module in enumerate(modules)
        ]

    def _hook(self, index: int, module: Any) -> Any:
        return recorder(module, self.calls[index], self.layers[index])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def attention_keywords(model: Any, ids: Any) -> list[dict[str, Any] | None]:
    """The keywords each layer's ``self_attn`` gets in a float64 forward of the token ids
    ``ids`` through ``model`` (transformers' decoder, its rotary already float64:
    rope_oracle.float64_rotary), its hidden states among them; ``None`` for a layer without
    one (a hybrid's other layers). What a test then calls the module with, changed."""
    import torch

    from .rope_oracle import float64_torch

    layers = getattr(model.model, "layers", None)
    if layers is not None:
        modules = {
            i: layer.self_attn for i, layer in enumerate(layers) if hasattr(layer, "self_attn")
        }
    else:  # HRM's stacks: the module of each cache slot (each module runs in several)
        from .pretrained_models import attention_modules

        modules = dict(zip(attention_layers(model), attention_modules(model), strict=True))
    calls: list[dict[str, Any] | None] = [None] * (
        len(layers) if layers is not None else len(modules)
    )

    def hook(index: int) -> Any:
        def save(module: Any, args: Any, kwargs: Any) -> None:
            calls[index] = {**kwargs, **({"hidden_states": args[0]} if args else {})}

        return save

    handles = [
        module.register_forward_pre_hook(hook(i), with_kwargs=True) for i, module in modules.items()
    ]
    try:
        with torch.no_grad(), float64_torch():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def compare_gradients(
    module: Any, grads: dict[str, Any], names: dict[str, Any], label: str, record: Any,
    tolerance: float,
) -> None:  # fmt: skip
    """Each parameter's gradient of transformers' ``module`` (after its backward) against
    ours in ``grads``, by ``names`` (transformers' name: ``(ours, transposed)``), each one
    that matters (above 1e-3), its error given to ``record(label, error)``; the indexer's
    parameters have none (its choice of keys has no gradient)."""
    from support.configs import relative_error

    for name, parameter in module.named_parameters():
        if name.startswith("indexer."):
            assert parameter.grad is None, name
            continue
        ours, transposed = names[name]
        theirs = parameter.grad.numpy().T if transposed else parameter.grad.numpy()
        assert np.abs(theirs).max() > 1e-3, name
        assert record(label, relative_error(grads[ours], theirs)) <= tolerance, name


def zeroed_calls(
    model: Any, module: Any, weight: Any, x: np.ndarray, rotary: Any, prefill: int,
    position_ids: bool = False,
) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
    """transformers' attention ``module`` of ``model`` on ``x (B, L, E)``, causal, in float64,
    with its parameter ``weight`` zeroed (put back afterwards): the whole sequence, then the
    prefill of ``prefill`` tokens and each later token on the model's cache. ``rotary``: the
    ``(cos, sin)`` of the whole sequence; ``position_ids``: the calls take their positions
    too."""
    import torch

    from support.pretrained_models import new_cache
    from support.rope_oracle import float64_torch

    B, L = x.shape[:2]
    cos, sin = rotary
    causal = torch.ones((B, 1, L, L), dtype=torch.bool).tril()

    def called(start: int, stop: int, cache: Any = None) -> np.ndarray:
        at = {"position_ids": torch.arange(start, stop)[None]} if position_ids else {}
        out: np.ndarray = module(
            hidden_states=torch.tensor(x[:, start:stop]),
            position_embeddings=(cos[:, start:stop], sin[:, start:stop]),
            attention_mask=causal[:, :, start:stop, :stop], cache=cache, **at,
        )[0].numpy()  # fmt: skip
        return out

    saved = weight.detach().clone()
    try:
        with torch.no_grad(), float64_torch():
            weight.zero_()
            whole, cache = called(0, L), new_cache(model)
            steps = [called(0, prefill, cache)]
            steps += [called(t, t + 1, cache) for t in range(prefill, L)]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    return whole, steps
