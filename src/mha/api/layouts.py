"""The weights of a :class:`mha.MultiHeadAttention` in other layouts: torch's
``nn.MultiheadAttention`` (module or state dict), GPT-2's fused Conv1D weights, the
``q_proj``/``k_proj``/``v_proj``/``o_proj`` layers of Llama-style models, and mha's own
``.npz`` files. The conversions themselves work on plain dicts of weights, in
:mod:`mha.integrations`; these methods check and wrap them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._arrays import flag, positive_int
from ..errors import AttentionValueError, WeightsFileError
from . import formats
from .configuration import Configuration, LayerSpec

if TYPE_CHECKING:
    from typing import Self

__all__ = ["Layouts"]


class Layouts(Configuration):
    """Loading and exporting weights (see :class:`mha.MultiHeadAttention`). A subclass whose
    layer holds more than a saved file or torch's module has a place for names it in
    ``not_saved`` and ``not_torch``, and :meth:`save` and the torch export refuse it."""

    not_saved: ClassVar[str | None] = None
    """What a saved file has no place for yet (``save`` refuses the layer, naming it)."""
    not_torch: ClassVar[str | None] = None
    """The attention ``torch.nn.MultiheadAttention`` cannot hold (the export refuses it)."""

    @classmethod
    def from_torch(
        cls, source: Any, *, num_heads: int | None = None, add_zero_attn: bool | None = None
    ) -> Self:
        """Load ``source``: a ``torch.nn.MultiheadAttention``, or its ``state_dict`` (then
        ``num_heads`` is needed; ``add_zero_attn``, a module setting that a state dict does
        not hold, defaults to False there and to the module's setting for a module).

        Every key and shape is checked. The result's ``forward`` takes batch-first arrays
        whatever the module's ``batch_first``; dropout is not carried over (inference).

        >>> from mha import MultiHeadAttention
        >>> import numpy as np
        >>> state = {"in_proj_weight": np.eye(12, 4), "out_proj.weight": np.eye(4)}
        >>> MultiHeadAttention.from_torch(state, num_heads=2)
        MultiHeadAttention(d_model=4, num_heads=2, bias=False, dtype=float64)
        """
        weights, heads, zero = formats.get("torch.weights")(source, num_heads, add_zero_attn)
        return cls.from_spec(LayerSpec(heads, add_zero_attn=zero), weights, "state dict")

    def to_torch_state_dict(self, *, tensors: bool = False) -> dict[str, Any]:
        """The weights as a ``torch.nn.MultiheadAttention`` state dict: NumPy arrays, or with
        ``tensors=True`` torch tensors, ready for ``load_state_dict`` in one line::

            torch_module.load_state_dict(attention.to_torch_state_dict(tensors=True))

        The torch module must be built with the same ``bias`` (torch's default is True,
        mha's False), ``kdim``, ``vdim`` and ``add_bias_kv``; :meth:`to_torch` builds it.

        >>> from mha import MultiHeadAttention
        >>> sorted(MultiHeadAttention(4, 2, bias=True).to_torch_state_dict())
        ['in_proj_bias', 'in_proj_weight', 'out_proj.bias', 'out_proj.weight']
        """
        self._check_torch_layout()
        state = formats.get("torch.state_dict")(self.weights())
        return formats.get("torch.tensors")(state) if flag("tensors", tensors) else dict(state)

    def to_torch(self, *, batch_first: bool = True) -> Any:
        """A ``torch.nn.MultiheadAttention`` in eval mode holding these weights, built with
        the matching ``bias``, ``kdim``, ``vdim``, ``add_bias_kv``, ``add_zero_attn`` and
        dtype, and ``batch_first`` as given (default True, like mha's arrays). Needs torch.

        >>> from mha import MultiHeadAttention
        >>> attention = MultiHeadAttention(8, 2, seed=0)
        >>> module = attention.to_torch()                  # doctest: +SKIP
        >>> module.bias_k is None, module.in_proj_bias is None   # doctest: +SKIP
        (True, True)
        """
        self._check_torch_layout()
        first = flag("batch_first", batch_first)
        module = formats.get("torch.module")
        return module(self.weights(), self.num_heads, self.add_zero_attn, first)

    @classmethod
    def from_gpt2(
        cls,
        c_attn_weight: Any,
        c_attn_bias: Any,
        c_proj_weight: Any,
        c_proj_bias: Any,
        num_heads: int,
    ) -> Self:
        """GPT-2's attention from its Conv1D weights, which are "x @ W" already:
        ``c_attn_weight (E, 3E)`` and ``c_attn_bias (3E,)`` (q, k, v fused), and
        ``c_proj_weight (E, E)`` with ``c_proj_bias (E,)``; ``num_heads`` is the model's
        ``n_head``. GPT-2 is causal: call ``forward(X, mask=True)``.

        >>> from mha import MultiHeadAttention
        >>> import numpy as np
        >>> E = 4
        >>> MultiHeadAttention.from_gpt2(np.ones((E, 3 * E)), np.zeros(3 * E), np.eye(E),
        ...                              np.zeros(E), num_heads=2)
        MultiHeadAttention(d_model=4, num_heads=2, bias=True, dtype=float64)
        """
        weights = formats.get("gpt2")(c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias)
        return cls.from_spec(LayerSpec(positive_int("num_heads", num_heads)), weights, "GPT-2")

    @classmethod
    def from_llama(
        cls,
        state_dict: Any,
        *,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float | None = 10000.0,
        rotary_dim: int | None = None,
        rotary_interleaved: bool = False,
        window: int | None = None,
        prefix: str = "",
    ) -> Self:
        """A Llama-style attention (Llama, Mistral, Qwen2, ...) from transformers' layout:
        ``state_dict`` holds ``{prefix}q_proj.weight``, ``k_proj``, ``v_proj``, ``o_proj``
        (``(out, in)``, NumPy arrays or torch tensors) and their ``.bias`` where present.
        ``num_heads``, ``num_kv_heads`` and ``head_dim`` are the config's ``num_attention_heads``,
        ``num_key_value_heads`` and ``head_dim`` (default ``hidden_size // num_heads``);
        gpt-oss's ``{prefix}sinks`` become the module's ``sinks`` (``num_heads`` logits);
        ``rope_theta``, ``rotary_dim`` (partial rotary) and ``rotary_interleaved`` set the
        rotary embedding (``rope_theta=None``: none); ``window`` is Mistral's
        ``sliding_window``. ``prefix`` selects one layer of a whole model's state dict, such
        as ``"model.layers.0.self_attn."``. Missing or misshapen keys are refused with the
        key's name and the expected shape. Llama attention is causal: call
        ``forward(x, mask=True)``, or use a cache.

        >>> from mha import MultiHeadAttention
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> state = {"q_proj.weight": rng.standard_normal((8, 8)),
        ...          "k_proj.weight": rng.standard_normal((4, 8)),
        ...          "v_proj.weight": rng.standard_normal((4, 8)),
        ...          "o_proj.weight": rng.standard_normal((8, 8))}
        >>> attention = MultiHeadAttention.from_llama(state, num_heads=4, num_kv_heads=2)
        >>> attention.num_kv_heads, attention.head_dim, attention.W_k.shape   # W_k = k_proj.T
        (2, 2, (8, 4))
        """
        H = positive_int("num_heads", num_heads)
        H_kv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if head_dim is not None:
            head_dim = positive_int("head_dim", head_dim)
        weights = formats.get("llama")(state_dict, prefix, H, H_kv, head_dim)  # checks state_dict
        W_q = weights["W_q"]
        spec = LayerSpec(
            H,
            H_kv,
            head_dim or (0 if W_q is None else W_q.shape[1] // H),
            rope_theta,
            rotary_dim,
            rotary_interleaved,
            window=window,
        )
        return cls.from_spec(spec, weights, "Llama weights")

    @classmethod
    def from_pretrained(cls, path: Any, layer: int = 0, *, dtype: Any = None) -> Self:
        """Layer ``layer``'s attention of a transformers checkpoint: the directory that
        ``save_pretrained`` writes (``config.json`` with ``model.safetensors``, or shards
        listed in ``model.safetensors.index.json``), or a llama.cpp GGUF file (each
        architecture of :data:`mha.integrations.gguf_file.ARCHITECTURES`: llama, qwen2,
        qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3, nemotron, stablelm, starcoder2,
        gpt2, bloom, falcon, lfm2, minimax-m2; dequantized by the ``gguf`` package, ``pip install
        'mha[models]'``: float32 unless ``dtype`` says otherwise), reading that layer's
        tensors alone.

        The result computes what that layer computes: its heads and key/value heads, head
        width, biases, scale (``query_pre_attn_scalar``), rotary positions with the config's
        ``rope_parameters`` (that layer's, as Gemma 3's local base), its sliding window or
        full attention (``layer_types``, Qwen2's ``max_window_layers``), QK-norm, sinks and
        soft-capping. ``dtype`` converts the weights (default: the checkpoint's, bfloat16
        as ``ml_dtypes.bfloat16`` when it is installed and exact float32 otherwise). What
        the config asks for that mha cannot compute exactly is refused by name; DeepSeek's
        latent attention loads with :meth:`mha.LatentAttention.from_pretrained`. The
        families, and what each reads, are in docs/pretrained.md.
        """
        spec, weights = formats.get("pretrained")(path, layer, dtype)
        kind = getattr(spec, "kind", None)
        if kind != getattr(cls, "kind", "attention"):
            what, by = {
                "latent": ("multi-head latent attention", "LatentAttention"),
                "differential": ("differential attention", "DifferentialAttention"),
                "block_sparse": ("block-sparse attention", "BlockSparseAttention"),
                "dynamic_mask": ("dynamic mask attention", "DynamicMaskAttention"),
                "segment_bias": ("attention with a bias by segment", "SegmentBiasAttention"),
            }.get(str(kind), ("multi-head attention", "MultiHeadAttention"))
            raise AttentionValueError(
                f"layer {layer} of {path} is {what}: load it with "
                f"mha.{by}.from_pretrained(path, layer={layer})"
            )
        return cls.from_spec(spec, weights, f"{path}, layer {layer}")

    def save(self, path: Any) -> None:
        """Write configuration and weights to ``path`` as ``.npz``, atomically: a complete
        file replaces any existing one, or nothing changes. A path that cannot be written
        is refused before anything is written.

        >>> from mha import MultiHeadAttention
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "attention.npz")
        >>> MultiHeadAttention(8, 2, seed=0).save(path)
        >>> os.listdir(os.path.dirname(path))
        ['attention.npz']
        """
        if self.not_saved is not None:
            raise AttentionValueError(
                f"a {type(self).__name__} is not saved to .npz files ({self.not_saved}: no "
                "place in them yet): keep attention.spec and its weights()"
            )
        formats.get("npz.save")(path, self._config(), self.weights())

    @classmethod
    def load(cls, path: Any) -> Self:
        """Read ``path``, a file written by :meth:`save` (never unpickling anything),
        checking every entry and shape against the configuration it records.

        >>> from mha import MultiHeadAttention
        >>> import os, tempfile, numpy as np
        >>> path = os.path.join(tempfile.mkdtemp(), "attention.npz")
        >>> saved = MultiHeadAttention(8, 2, bias=True, seed=0)
        >>> saved.save(path)
        >>> loaded = MultiHeadAttention.load(path)
        >>> loaded, bool(np.array_equal(loaded.W_q, saved.W_q))
        (MultiHeadAttention(d_model=8, num_heads=2, bias=True, dtype=float64), True)
        """
        config, weights = formats.get("npz.load")(path)
        required = (
            "num_heads",
            "add_zero_attn",
            "num_kv_heads",
            "head_dim",
            "rope_theta",
            "rotary_dim",
            "rotary_interleaved",
            "window",
        )
        try:
            defaults = LayerSpec(num_heads=1)  # the later settings: older files lack them
            given: dict[str, Any] = {
                key: config[key] if key in required else config.get(key, getattr(defaults, key))
                for key in LayerSpec.fields()
            }
            spec = LayerSpec(**given)
            module = cls.from_spec(spec, weights, "the weights")
        except KeyError as error:
            raise WeightsFileError(f"cannot load {path}: its config has no {error}") from None
        except (AttentionValueError, TypeError) as error:
            raise WeightsFileError(f"cannot load {path}: {error}") from None
        found = module._config()
        differences = [
            f"{key}={config.get(key)!r} but the weights give {found[key]!r}"
            for key in found
            if config.get(
                key, {"sinks": False, "q_scale": False, "qdim": found["d_model"]}.get(key)
            )
            != found[key]
        ]
        if differences:
            raise WeightsFileError(f"cannot load {path}: its config says " + "; ".join(differences))
        return module

    def _check_torch_layout(self) -> None:
        """Refuse what ``torch.nn.MultiheadAttention`` cannot hold."""
        if self.not_torch is not None:
            raise AttentionValueError(
                f"torch.nn.MultiheadAttention cannot hold {self.not_torch}: {self!r}"
            )
        beyond = [
            what
            for what, present in (
                ("grouped key/value heads", self.num_kv_heads != self.num_heads),
                ("head_dim * num_heads != d_model", self.head_dim * self.num_heads != self.d_model),
                ("queries of another width than d_model (qdim)", self.qdim != self.d_model),
                ("values of another head width", self.v_head_dim != self.head_dim),
                ("rotary embeddings", self.rope_theta is not None),
                ("a sliding window", self.window is not None),
                (
                    "a scale other than 1/sqrt(head_dim)",
                    self.scale is not None and self.scale != 1.0 / float(np.sqrt(self.head_dim)),
                ),
                ("QK-norm", self.qk_norm is not None),
                ("an output gate", self.output_gate is not None),
                ("clip_qkv", self.clip_qkv is not None),
                ("v_norm", self.v_norm is not None),
                ("an output norm", self.output_norm is not None),
                ("a query scale", self.q_scale is not None),
                *((f"{name}=", True) for name in self.variants()),
                ("only some of the biases", self._partial_biases() != ""),
            )
            if present
        ]
        if beyond:
            raise AttentionValueError(
                f"torch.nn.MultiheadAttention cannot hold this attention ({', '.join(beyond)}): "
                f"{self!r}"
            )
