"""Block-sparse top-k attention (:mod:`mha.api.block_sparse`): MiniMax-M3's lightning indexer on
:class:`mha.BlockSparseAttention`, against transformers' own layers.

The layers are those of the tiny checkpoint of support.pretrained_models (blocks of 4 keys, 3
of the 6 blocks of 24 positions kept, 2 of them local), loaded by transformers in float64 with
the float64 rotary of support.rope_oracle; a pre-hook captures the keywords each ``self_attn``
gets in a model forward and the layer is called again with them, under ``float64_torch``.

* The choice: the keys each query keeps are those of transformers' ``build_block_mask``, head
  by head; and a layer whose indexer scores every key alike (its ``q_proj`` zeroed: every
  visible score is 0) matches transformers' whole and in decoding, the blocks kept among ties
  being torch's.
* The cache of the indexer's keys: ``truncate`` and ``reorder``, and the errors a caller can
  cause, by name; the reader's refusals and an older config's ``sparse_attention_config``.

The gradient given the choice is in test_pretrained_gradients.py, the layer-by-layer
comparison (whole sequences, prefill then decoding past the blocks kept) in test_pretrained.py.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error
from support.transformers_oracle import zeroed_calls

import mha
from mha.api.block_sparse import BlockIndexerSpec, choose_blocks, index_keys
from mha.api.sparse import SparseKVCache
from mha.errors import AttentionValueError

B, L, PREFILL = 2, 24, 10
FAMILY = "minimax_m3_vl_text"


def captured():
    """The float64 transformers model and each layer's ``self_attn`` keywords in a forward
    over ``B`` sequences of ``L`` tokens."""
    return models.captured(FAMILY, B, L, 64)


def load(layer):
    return mha.from_pretrained(models.saved(FAMILY), layer=layer, dtype=np.float64)


@pytest.mark.parametrize("layer", [0, 2])
def test_the_keys_chosen_are_transformers_indexers(layer, transformers):
    import torch
    from support.rope_oracle import float64_torch

    model, calls = captured()
    module = model.model.layers[layer].self_attn
    keywords = calls[layer]
    x = np.random.default_rng(layer).standard_normal((B, L, 48))
    positions = torch.arange(L)[None].expand(B, -1)
    with torch.no_grad(), float64_torch():
        hidden = torch.tensor(x)
        blocks = module.indexer(hidden, keywords["position_embeddings"], None, positions)
        additive = module.indexer.build_block_mask(
            blocks, None, L, torch.float64, hidden.device, positions
        )
    expected = (additive == 0).numpy()  # (B, H, L, L)
    attention = load(layer)
    at = np.broadcast_to(np.arange(L), (B, L))
    W = {name: getattr(attention, name) for name in mha.api.block_sparse.BLOCK_INDEXER_WEIGHTS}
    rotary = attention._rotary()
    keys = index_keys(attention.indexer, x, W, at, rotary)
    chosen = choose_blocks(attention.indexer, x, W, at, keys, rotary)
    chosen = np.repeat(chosen, attention.num_heads // attention.indexer.num_heads, axis=1)
    assert np.array_equal(chosen, expected)
    kept = chosen[..., -1, :].sum(-1)  # the last query: 3 blocks of 4 keys, not all 24
    assert (kept == 12).all() and not np.array_equal(chosen[:, 0], chosen[:, -1])


def test_blocks_tied_in_score_are_chosen_as_transformers_chooses(transformers):
    """Every visible score 0: which blocks beside the local ones each query keeps is
    torch.topk's tie order alone."""

    model, calls = captured()
    module = model.model.layers[0].self_attn
    x = np.random.default_rng(2).standard_normal((B, L, 48))
    cos, sin = calls[0]["position_embeddings"]
    expected, steps = zeroed_calls(
        model, module, module.indexer.q_proj.weight, x, (cos, sin), PREFILL, position_ids=True
    )
    attention = load(0)
    attention.W_index_q[...] = 0.0
    assert relative_error(attention(x, mask=True), expected) <= 1e-12
    ours = attention.new_cache(B)
    ours = [attention(x[:, :PREFILL], cache=ours)] + [
        attention(x[:, t : t + 1], cache=ours) for t in range(PREFILL, L)
    ]
    for step, theirs in zip(ours, steps, strict=True):
        assert relative_error(step, theirs) <= 1e-12
    # every block kept (a dense causal attention) computes something else
    dense = mha.BlockSparseAttention.from_spec(
        mha.BlockSparseSpec(**{**attention.spec.__dict__,
                               "block_indexer": BlockIndexerSpec(4, 6, 2, 2, 10)}),
        attention.weights(),
    )  # fmt: skip
    assert relative_error(dense(x, mask=True), expected) > 1e-3


def test_the_cache_keeps_the_indexers_keys_through_truncate_and_reorder(transformers):
    attention = load(2)
    x = np.random.default_rng(3).standard_normal((B, 18, 48))
    whole = attention(x, mask=True)
    cache = attention.new_cache(B, capacity=4)  # grown as needed
    assert isinstance(cache, SparseKVCache) and cache.index_keys.shape == (B, 0, 10)
    attention(x[:, :12], cache=cache)
    attention(x[:, 12:14], cache=cache)
    cache.truncate([12, 12])  # the two tokens rejected, then computed again
    assert cache.index_keys.shape == (B, 12, 10)
    steps = [attention(x[:, t : t + 1], cache=cache) for t in range(12, 18)]
    assert relative_error(np.concatenate(steps, axis=1), whole[:, 12:]) <= 1e-12
    cache.reorder([1, 0])  # the sequences swapped, then one more token each
    token = np.random.default_rng(6).standard_normal((B, 1, 48))
    swapped = attention(token, cache=cache)
    again = attention.new_cache(B)
    attention(x[::-1], cache=again)
    assert relative_error(swapped, attention(token, cache=again)) <= 1e-12


def test_what_a_caller_can_get_wrong_is_named(transformers):
    attention = load(0)
    x = np.random.default_rng(4).standard_normal((B, 6, 48))
    for keywords, said in [
        ({"key": x}, "key= is not taken by block-sparse attention"),
        ({"query_lengths": [6, 5]}, "query_lengths= is not taken"),
        ({"mask_mod": lambda b, h, q, kv: q >= kv}, "its indexer's choice is the layer's"),
        ({"cache": mha.KVCache(B, 2, 12)}, "keeps its indexer's keys beside its own"),
        ({"cache": attention.new_cache(B), "mask": np.ones((6, 6), bool)}, "mask array"),
    ]:
        with pytest.raises(AttentionValueError, match=said):
            attention(x, **keywords)
    spec = attention.spec.__dict__
    for indexer, said in [
        (BlockIndexerSpec(4, 3, 2, 3, 10), "num_heads=3 does not divide the layer's 4"),
        (BlockIndexerSpec(4, 3, 2, 2, 4), "head_dim=4 is narrower than the layer's rotated"),
        (BlockIndexerSpec(0, 3, 2, 2, 10), "block_size"),
        ("blocks", "indexer must be a BlockIndexerSpec"),
    ]:
        with pytest.raises(AttentionValueError, match=said):
            mha.BlockSparseAttention.from_spec(
                mha.BlockSparseSpec(**{**spec, "block_indexer": indexer}), attention.weights()
            )
    with pytest.raises(AttentionValueError, match=r"load it with mha\.BlockSparseAttention"):
        mha.MultiHeadAttention.from_pretrained(models.saved(FAMILY), layer=0)
    with pytest.raises(AttentionValueError, match=r"not saved to \.npz files"):
        attention.save("unused.npz")


def test_the_reader_refuses_by_name_and_reads_older_configs(tmp_path, transformers):
    source = models.saved(FAMILY)
    x = np.random.default_rng(5).standard_normal((B, 12, 48))
    expected = load(0)(x, mask=True)
    folder = tmp_path / "m3"
    shutil.copytree(source, folder)
    config = json.loads((source / "config.json").read_text())

    def with_config(**changes):
        written = {key: value for key, value in {**config, **changes}.items() if value != ...}
        (folder / "config.json").write_text(json.dumps(written))

    # an older config: the indexer's settings and sparse layers in sparse_attention_config
    legacy = {"sparse_num_index_heads": 2, "sparse_index_dim": 10, "sparse_block_size": 4,
              "sparse_topk_blocks": 3, "sparse_local_block": 2,
              "sparse_attention_freq": [1, 0, 1]}  # fmt: skip
    flat = ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
            "index_local_blocks", "layer_types")  # fmt: skip
    with_config(sparse_attention_config=legacy, **dict.fromkeys(flat, ...))
    read = mha.from_pretrained(folder, layer=0, dtype=np.float64)
    assert relative_error(read(x, mask=True), expected) <= 1e-12
    assert type(mha.from_pretrained(folder, layer=1)) is mha.MultiHeadAttention
    for changes, said in [
        ({"index_n_heads": 3}, r"index_n_heads=3, which does not divide its 4 heads"),
        ({"index_head_dim": 4}, r"index_head_dim=4 narrower than the 6 rotated features"),
        ({"layer_types": ["minimax_m3_sparse", "linear", "full_attention"]},
         r"layer_types\[1\]='linear'"),
        ({"index_block_size": 0}, r"index_block_size=0 \(the block indexer needs a count\)"),
    ]:  # fmt: skip
        with_config(**changes)
        with pytest.raises(AttentionValueError, match=said) as error:
            mha.from_pretrained(folder, layer=1 if "layer_types" in changes else 0)
        assert str(folder) in str(error.value)


def test_the_walk_skips_the_blocks_of_keys_no_query_chose():
    """Blocks of 128 keys, as the kernel's block map's: a query keeping its own block alone
    leaves every other block of the map empty (skipped), and computes what a mask of the
    same keys computes on a dense layer."""
    from mha._kernel.block_mask import EMPTY, classify

    indexer = BlockIndexerSpec(block_size=128, topk_blocks=1, local_blocks=1, num_heads=1,
                               head_dim=8)  # fmt: skip
    layer = mha.BlockSparseAttention(16, 2, indexer=indexer, rope_theta=100.0, seed=0)
    x = np.random.default_rng(7).standard_normal((1, 512, 16))
    at = np.arange(512)[None]
    W = {name: getattr(layer, name) for name in mha.api.block_sparse.BLOCK_INDEXER_WEIGHTS}
    keys = index_keys(layer.indexer, x, W, at, layer._rotary())
    chosen = choose_blocks(layer.indexer, x, W, at, keys, layer._rotary())
    choice = mha.api.block_sparse.ChosenKeys(chosen, np.zeros(1, np.int64), 2)
    blocks, _ = classify(choice, np.arange(1), 2, at, at)
    assert blocks.shape == (1, 2, 4, 4)
    assert ((blocks == EMPTY) == ~np.eye(4, dtype=bool)).all()
    plain = mha.MultiHeadAttention.from_spec(
        mha.LayerSpec(**{f: getattr(layer.spec, f) for f in mha.LayerSpec.fields()}),
        {name: w for name, w in layer.weights().items() if name not in W},
    )
    expected = plain(x, mask=np.repeat(chosen, 2, axis=1))
    assert relative_error(layer(x, mask=True), expected) <= 1e-13


QWEN4 = "qwen4_exp_text"


@functools.cache
def captured_qwen4():
    """As :func:`captured`, for Qwen4-Exp, whose decoder gives ``position_embeddings`` by
    position: each indexed layer's keywords, by layer index."""
    import torch
    from support.rope_oracle import float64_rotary, float64_torch

    model = models.transformers_model(QWEN4)
    float64_rotary(model)
    ids = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(0))
    calls = {}

    def hook(index):
        def save(module, args, kwargs):
            names = ("hidden_states", "position_embeddings")
            calls[index] = {**kwargs, **dict(zip(names, args, strict=False))}

        return save

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i in (0, 2)]  # fmt: skip
    try:
        with torch.no_grad(), float64_torch():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return model, calls


def test_qsa_blocks_tied_in_score_are_chosen_as_transformers_chooses(transformers):
    """Qwen4-Exp's QSA with every score 0 (its query rows zeroed): which blocks each query
    keeps is torch.topk's tie order over the blocks it sees, whole and in decoding."""
    import torch
    from support.rope_oracle import float64_torch

    model, calls = captured_qwen4()
    module = model.model.layers[0].self_attn
    x = np.random.default_rng(8).standard_normal((B, L, 48))
    cos, sin = calls[0]["position_embeddings"]
    causal = torch.ones((B, 1, L, L), dtype=torch.bool).tril()

    def called(start, stop, cache=None):  # the layer on x[:, start:stop], its keys' rope whole
        return module(
            hidden_states=torch.tensor(x[:, start:stop]),
            position_embeddings=(cos[:, :stop], sin[:, :stop]),
            attention_mask=causal[:, :, start:stop, :stop],
            cache=cache,
        )[0].numpy()

    weight = module.indexer.index_qk_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad(), float64_torch():
            weight[: 2 * 12].zero_()  # the indexer's 2 query heads of 12
            expected = called(0, L)
            cache = models.new_cache(model)
            steps = [called(0, PREFILL, cache)]
            steps += [called(t, t + 1, cache) for t in range(PREFILL, L)]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    attention = mha.from_pretrained(models.saved(QWEN4), layer=0, dtype=np.float64)
    attention.W_index_qk[:, : 2 * 12] = 0.0
    assert relative_error(attention(x, mask=True), expected) <= 1e-12
    ours = attention.new_cache(B)
    ours = [attention(x[:, :PREFILL], cache=ours)] + [
        attention(x[:, t : t + 1], cache=ours) for t in range(PREFILL, L)
    ]
    for step, theirs in zip(ours, steps, strict=True):
        assert relative_error(step, theirs) <= 1e-12
    with pytest.raises(AttentionValueError, match="a mask array is not taken by a QSA"):
        attention(x, mask=np.tri(L, dtype=bool))


@pytest.mark.parametrize("layer", [0, 2])
def test_qsa_gradients_given_the_choice_match_autograd(layer, torch, transformers, record_error):
    """The gradient of Qwen4-Exp's gated attention given its QSA choice, every weight's (the
    query and gate rows of q_proj apart) and the input's, to 1e-10."""
    from support.rope_oracle import float64_torch

    model, calls = captured_qwen4()
    module = model.model.layers[layer].self_attn
    g = np.random.default_rng(layer + 9)
    x = 0.7 * g.standard_normal((B, L, 48))
    grad_out = g.standard_normal((B, L, 48))
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**calls[layer], "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()
    attention = mha.from_pretrained(models.saved(QWEN4), layer=layer, dtype=np.float64)
    out, backward = attention(x, mask=True, return_backward=True)
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    grads = backward(grad_out)
    grads["query"] = grads["query"] + grads["key"] + grads["value"]  # the shared input's
    H, d = attention.num_heads, attention.head_dim
    theirs = {name: p.grad for name, p in module.named_parameters()}
    assert all(theirs[name] is None for name in theirs if name.startswith("indexer."))
    fused = theirs["q_proj.weight"].numpy().reshape(H, 2, d, 48)  # each head: query, gate
    expected_grads = {
        "W_q": fused[:, 0].reshape(H * d, 48).T,
        "W_g": fused[:, 1].reshape(H * d, 48).T,
        "W_k": theirs["k_proj.weight"].numpy().T,
        "W_v": theirs["v_proj.weight"].numpy().T,
        "W_o": theirs["o_proj.weight"].numpy().T,
        "q_norm": theirs["q_norm.weight"].numpy(),
        "k_norm": theirs["k_norm.weight"].numpy(),
        "query": tx.grad.numpy(),
    }
    label = f"pretrained {QWEN4} gradients vs autograd, float64"
    for name, value in expected_grads.items():
        assert np.abs(value).max() > 1e-3, name
        assert record_error(label, relative_error(grads[name], value)) <= 1e-10, name
