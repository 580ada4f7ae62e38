"""What Gemma 3n and Gemma 4 add to the attention. ``v_norm``: each value head divided by its
root mean square, without weights, after the projection; the forward against a torch
transcription of transformers' layer (QK-norm, rotation, the value norm, a scale of 1), the
backward against torch.autograd, in float64; the module's caches (holding the normalised
values), saved files and mha.dask; the errors. KV sharing (``shares_kv_with``): a layer
reading another layer's cache without appending, against the same queries over that
layer's keys and values. The checkpoints' layers against transformers' attention modules
(their settings and weights: a sharing layer's keys and values are its owner's, keys as
values), and what mha refuses of Gemma 4's configs. The families' layers are compared with
transformers' outputs in tests/test_pretrained.py and the census."""

from __future__ import annotations

import numpy as np
import pytest
from support.configs import relative_error
from support.torch_reference import rope

import mha
from mha.errors import AttentionTypeError, AttentionValueError

B, L, E, d = 2, 7, 12, 4
EPS = 1e-6

CASES = [(3, 3, True), (4, 2, True), (4, 1, False), (2, 2, False)]  # heads, kv heads, rotary


def layer(seed, H, H_kv):
    g = np.random.default_rng(seed)
    widths = {"W_q": (E, H * d), "W_k": (E, H_kv * d), "W_v": (E, H_kv * d), "W_o": (H * d, E)}
    w = {name: g.standard_normal(shape) * 0.6 for name, shape in widths.items()}
    w["q_norm"], w["k_norm"] = g.standard_normal(d), g.standard_normal(d)
    return w, g.standard_normal((B, L, E))


def torch_gemma(torch, x, w, H, H_kv, theta):
    """transformers' Gemma 3n and Gemma 4 order: project, split, RMSNorm q and k (weights)
    and v (none), rotate q and k, attend with a scale of 1."""

    def rms(t, weight=None):
        t = t * torch.pow(t.pow(2).mean(-1, keepdim=True) + EPS, -0.5)
        return t if weight is None else t * weight

    q, k, v = ((x @ w[n]).view(B, L, h, d) for n, h in (("W_q", H), ("W_k", H_kv), ("W_v", H_kv)))
    q, k, v = rms(q, w["q_norm"]), rms(k, w["k_norm"]), rms(v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if theta is not None:
        q, k = rope(torch, q, range(L), theta), rope(torch, k, range(L), theta)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=1.0, enable_gqa=True
    )
    return out.transpose(1, 2).reshape(B, L, -1) @ w["W_o"]


def ours(x, w, H, H_kv, theta, **keywords):
    return mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, scale=1.0, q_norm=w["q_norm"], k_norm=w["k_norm"], qk_norm="head",
        qk_norm_eps=EPS, v_norm=EPS, **keywords,
    )  # fmt: skip


@pytest.mark.parametrize(("H", "H_kv", "rotary"), CASES)
def test_v_norm_forward_and_backward_match_torch(H, H_kv, rotary, torch, record_error):
    w, x = layer(H * 10 + H_kv, H, H_kv)
    theta = 100.0 if rotary else None
    out, backward = ours(x, w, H, H_kv, theta, return_backward=True)
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    expected = torch_gemma(torch, tx, tensors, H, H_kv, theta)
    error = relative_error(out, expected.detach().numpy())
    assert record_error("v_norm forward vs torch, float64", error) <= 1e-13
    without = mha.multi_head_attention(
        x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], H, num_kv_heads=H_kv, causal=True,
        rope_theta=theta, scale=1.0, q_norm=w["q_norm"], k_norm=w["k_norm"], qk_norm_eps=EPS,
    )  # fmt: skip
    assert relative_error(without, out) > 1e-3  # the norm changes the values
    grad = np.random.default_rng(5).standard_normal(out.shape)
    expected.backward(torch.tensor(grad))
    grads = backward(grad)
    for name, tensor in {**tensors, "Q": tx}.items():
        found = grads[name] if name != "Q" else grads["Q"] + grads["K"] + grads["V"]
        error = relative_error(found, tensor.grad.numpy())
        assert record_error(f"v_norm gradient of {name} vs autograd", error) <= 1e-10, name


def test_v_norm_module_cache_and_saved_file_match_the_function(tmp_path):
    """The module computes the function's values; a cache holds the normalised values, and
    a prefill then one token at a time gives the whole sequence's outputs (a paged cache
    too)."""
    w, x = layer(3, 4, 2)
    attention = mha.MultiHeadAttention(E, 4, num_kv_heads=2, head_dim=d, rope_theta=100.0,
                                       scale=1.0, qk_norm="head", v_norm=EPS, seed=0)  # fmt: skip
    for name in ("W_q", "W_k", "W_v", "W_o", "q_norm", "k_norm"):
        setattr(attention, name, w[name])
    whole = attention(x, mask=True)
    assert relative_error(whole, ours(x, w, 4, 2, 100.0)) <= 1e-15
    cache = attention.new_cache(B)
    steps = [attention(x[:, :3], cache=cache)]
    steps += [attention(x[:, i : i + 1], cache=cache) for i in range(3, L)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    held = cache.v[:, :, :L]
    assert np.allclose(np.mean(held * held, axis=-1), 1.0, atol=1e-5)  # the normalised ones
    assert attention.spec.v_norm == EPS and "v_norm=1e-06" in repr(attention)
    paged = mha.PagedKVCache(16, 4, 2, d, dtype=np.float64)
    paged.add("a")
    paged.add("b")
    steps = [attention(x[:, :5], cache=paged), attention(x[:, 5:], cache=paged)]
    assert relative_error(np.concatenate(steps, axis=1), whole) <= 1e-13
    attention.save(tmp_path / "layer.npz")
    loaded = mha.MultiHeadAttention.load(tmp_path / "layer.npz")
    assert loaded.v_norm == EPS
    assert np.array_equal(loaded(x, mask=True), whole)


def test_v_norm_errors_name_the_keyword(torch):
    w, x = layer(1, 2, 2)
    with pytest.raises(AttentionTypeError, match="v_norm is the epsilon"):
        mha.MultiHeadAttention(8, 2, v_norm=True)
    with pytest.raises(AttentionValueError, match="v_norm must be a positive number"):
        mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], 2, v_norm=0.0)
    with pytest.raises(AttentionValueError, match=r"torch\.nn\.MultiheadAttention cannot hold"):
        mha.MultiHeadAttention(8, 2, v_norm=1e-6).to_torch()


def test_v_norm_in_dask_is_the_in_memory_value():
    da = pytest.importorskip("dask.array")
    import mha.dask

    w, x = layer(4, 4, 2)
    keywords = {"num_kv_heads": 2, "causal": True, "rope_theta": 100.0, "scale": 1.0,
                "q_norm": w["q_norm"], "k_norm": w["k_norm"], "v_norm": EPS}  # fmt: skip
    exact = mha.multi_head_attention(x, x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], 4, **keywords)
    lazy = mha.dask.multi_head_attention(
        da.from_array(x, chunks=(1, 4, E)), x, x, w["W_q"], w["W_k"], w["W_v"], w["W_o"], 4,
        **keywords,
    )  # fmt: skip
    assert relative_error(lazy.compute(scheduler="sync"), exact) <= 1e-14


# KV sharing ----------------------------------------------------------------------------


def sharing_pair(window=None):
    """Layer 0 and a layer 3 attending with layer 0's keys and values, and a reference for
    layer 3: the same queries, over keys and values projected by layer 0's weights."""
    settings = {"num_kv_heads": 2, "head_dim": d, "rope_theta": 100.0, "scale": 1.0,
                "qk_norm": "head", "v_norm": EPS, "window": window}  # fmt: skip
    owner = mha.MultiHeadAttention(E, 4, seed=0, **settings)
    shared = mha.MultiHeadAttention(E, 4, seed=1, shares_kv_with=0, **settings)
    reference = mha.MultiHeadAttention(E, 4, seed=1, **settings)
    reference.W_k, reference.W_v, reference.k_norm = owner.W_k, owner.W_v, owner.k_norm
    return owner, shared, reference


@pytest.mark.parametrize("window", [None, 3])
def test_a_shared_layer_reads_the_owners_cache_without_appending(window):
    """Whole sequences (the owner's cache without a window) and a prefill then one token at
    a time (the owner's own cache, with its window): the queries of the sharing layer over
    the owner's keys and values, which its calls leave as they are."""
    owner, shared, reference = sharing_pair(window)
    g = np.random.default_rng(2)
    x_owner, x = g.standard_normal((2, B, 9, E))
    expected = reference(x, key=x_owner, mask=True)
    cache = mha.KVCache(B, 2, d)
    owner(x_owner, cache=cache)
    held = cache.k.copy()
    assert relative_error(shared(x, cache=cache), expected) <= 1e-15
    assert cache.lengths.tolist() == [9, 9] and np.array_equal(cache.k, held)
    cache = owner.new_cache(B)
    steps = []
    for start, stop in [(0, 4), *((t, t + 1) for t in range(4, 9))]:
        owner(x_owner[:, start:stop], cache=cache)
        steps.append(shared(x[:, start:stop], cache=cache))
    assert relative_error(np.concatenate(steps, axis=1), expected) <= 1e-14
    assert "shares_kv_with=0" in repr(shared) and shared.spec.shares_kv_with == 0


def test_a_shared_layer_refuses_what_it_cannot_read(tmp_path):
    owner, shared, _ = sharing_pair(window=3)
    x = np.random.default_rng(3).standard_normal((B, 9, E))
    with pytest.raises(AttentionValueError, match="attends with layer 0's keys and values"):
        shared(x, mask=True)
    with pytest.raises(AttentionTypeError, match=r"an mha\.KVCache; got PagedKVCache"):
        shared(x, cache=mha.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=d))
    cache = owner.new_cache(B)
    owner(x, cache=cache)  # a prompt longer than the window: the first positions are gone
    with pytest.raises(AttentionValueError, match="no longer holds the positions"):
        shared(x, cache=cache)
    with pytest.raises(AttentionValueError, match="fewer than the 10 new tokens"):
        shared(np.concatenate([x, x[:, :1]], axis=1), cache=cache)
    with pytest.raises(AttentionValueError, match="query_lengths= cannot be combined"):
        shared(x[:, :1], cache=cache, query_lengths=[1, 1])
    shared.save(tmp_path / "shared.npz")
    assert mha.MultiHeadAttention.load(tmp_path / "shared.npz").shares_kv_with == 0


# The checkpoints' layers against transformers' modules -----------------------------------


@pytest.mark.parametrize("family", ["gemma3n", "gemma4", "gemma4_unified"])
def test_each_layer_reads_what_transformers_modules_hold(family, transformers):
    """Settings against transformers' attention modules (their width, heads, scaling,
    window, norms' epsilons, which layer's keys and values they take), weights against
    the modules' own: a sharing layer's keys and values are its owner's, a layer whose
    values are its keys' projection has ``W_v == W_k``."""
    from support import pretrained_models as models

    from mha.integrations.checkpoint import Checkpoint
    from mha.integrations.readers import layer_attention

    model = models.transformers_model(family)
    config, modules = model.config, models.attention_modules(model)
    modes = config.kv_sharing_modes
    for index, attention in enumerate(modules):
        _, settings, weights = layer_attention(Checkpoint(models.saved(family)), index, np.float64)
        heads = attention.q_proj.out_features // attention.head_dim
        assert (settings["num_heads"], settings["head_dim"]) == (heads, attention.head_dim)
        assert settings["scale"] == attention.scaling == 1.0
        assert settings["window"] == attention.sliding_window
        assert settings["v_norm"] == settings["qk_norm_eps"] == config.rms_norm_eps
        owner = index
        if modes[index] == "reuse":
            owner = settings["shares_kv_with"]
            assert modes[owner] == "store" and attention.layer_type == modules[owner].layer_type
        else:
            assert settings["shares_kv_with"] is None
        source = modules[owner]
        assert settings["num_kv_heads"] == source.k_proj.out_features // attention.head_dim
        own = {"W_q": attention.q_proj, "W_o": attention.o_proj, "W_k": source.k_proj}
        own |= {"W_v": source.v_proj if source.v_proj is not None else source.k_proj}
        for name, module in own.items():
            assert np.array_equal(weights[name], module.weight.detach().numpy().T), name
        assert np.array_equal(weights["q_norm"], attention.q_norm.weight.detach().numpy())
        assert np.array_equal(weights["k_norm"], source.k_norm.weight.detach().numpy())
        keys_as_values = getattr(source, "use_alternative_attention", False)
        assert keys_as_values == (family == "gemma4" and index > 0)
        assert sorted(weights) == ["W_k", "W_o", "W_q", "W_v", "k_norm", "q_norm"]


def test_the_values_of_keys_as_values_are_read_from_the_keys(monkeypatch, transformers):
    """Gemma 4's full layers with ``attention_k_eq_v`` have no ``v_proj``: a row that does
    not read the key would look for one, and not find it."""
    from dataclasses import replace

    from support import pretrained_models as models

    from mha.integrations import readers

    row = readers.FAMILIES["gemma4_text"]
    unread = replace(row, values=replace(row.values, keys=None))
    monkeypatch.setitem(readers.FAMILIES, "gemma4_text", unread)
    with pytest.raises(mha.WeightsFileError, match=r"lacks v_proj\.weight"):
        mha.from_pretrained(models.saved("gemma4"), layer=1)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"per_layer_config": {"1": {"sliding_window": 3}}}, r"per_layer_config\[1\] overriding"),
        ({"per_layer_config": {"1": {"head_dim": 0}}}, "heads of layer 1 .* must be positive"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5; a number of its 3 layers"),
    ],
)
def test_what_gemma4_computes_beyond_mha_is_refused_by_name(tmp_path, change, refusal,
                                                            transformers):  # fmt: skip
    import json
    import shutil

    from support import pretrained_models as models

    folder = shutil.copytree(models.saved("gemma4"), tmp_path / "gemma4")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AttentionValueError, match=refusal) as error:
        mha.from_pretrained(folder, layer=1)
    assert str(folder) in str(error.value)


def test_older_gemma4_configs_give_the_full_layers_heads_by_global_keys(tmp_path, transformers):
    """A config without ``per_layer_config``: the full layers' ``global_head_dim`` and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``, as the config class reads them."""
    import json
    import shutil

    from support import pretrained_models as models

    folder = shutil.copytree(models.saved("gemma4"), tmp_path / "gemma4")
    config = json.loads((folder / "config.json").read_text())
    del config["per_layer_config"]
    config |= {"global_head_dim": 16, "num_global_key_value_heads": 1}
    (folder / "config.json").write_text(json.dumps(config))
    for index in range(3):
        ours = mha.from_pretrained(folder, layer=index)
        theirs = mha.from_pretrained(models.saved("gemma4"), layer=index)
        assert ours.spec == theirs.spec, index
    del config["global_head_dim"]  # the config class's 512
    config["layer_types"] = ["sliding_attention"] * 3  # the last layer full all the same
    (folder / "config.json").write_text(json.dumps(config))
    assert mha.from_pretrained(folder, layer=0).window == 5
    with pytest.raises(mha.WeightsFileError, match=r"lacks v_proj\.weight"):  # a sliding layer
        mha.from_pretrained(folder, layer=1)
    with pytest.raises(AttentionValueError, match="no layer before layer 2 is a full_attention"):
        mha.from_pretrained(folder, layer=2)
