"""The user-facing layer, one responsibility a file (the public import paths are ``mha``,
``mha.functional``, ``mha.module``, ``mha.cache`` and ``mha.rotary``):

* ``split_heads``: :func:`mha.scaled_dot_product_attention` on heads already projected, its
  cached call, and :func:`mha.merge_attention`;
* ``projection``: :func:`mha.multi_head_attention`, which projects, rotates, appends the
  extra keys, attends and projects back;
* ``checks``: every check of the entry points' arguments (shared with :mod:`mha.dask`);
* ``gradients``: the ``backward`` objects of ``return_backward=True``;
* ``module``, ``configuration``, ``layouts``: :class:`mha.MultiHeadAttention`, its settings
  and weights, and their other layouts (torch, GPT-2, Llama, files);
* ``cache``: :class:`mha.KVCache`; ``rotary``: :func:`mha.apply_rotary`, with
  ``rope_scaling``: transformers' rope types;
* ``qk_norm``: the RMSNorm of queries and keys (Qwen3, Gemma 3, OLMo 2), both ways;
  ``v_norm``: the values' RMSNorm without weights (Gemma 3n, Gemma 4); ``shared_kv``: a
  layer attending with another layer's cache, read without appending (KV sharing);
* ``latent``, ``latent_math``: :class:`mha.LatentAttention` (DeepSeek's multi-head latent
  attention, by the absorbed form on the same kernel);
* ``signatures``: the keyword options behind the entry points' typed overloads.

Everything here computes through :mod:`mha._kernel`; nothing here imports the command line
or the integrations that build on this layer (Dask, torch's functional API); the loaders
(``from_pretrained``, ``from_llama``) import the file formats they read when called.
"""
