"""Sparse top-k attention (:mod:`mha.api.sparse`): DeepSeek-V3.2's and GLM-MoE-DSA's
lightning indexer on :class:`mha.LatentAttention`, against transformers' own layers.

The layers are those of the tiny checkpoints of support.pretrained_models (``index_topk`` 4
and 5 of 24 positions), loaded by transformers in float64 with the float64 rotary of
support.rope_oracle; a pre-hook captures the keywords each ``self_attn`` gets in a model
forward (its rotary cosines and sines, its causal mask) and the layer is called again with
them, under ``float64_torch`` (the RMSNorms' and the indexer's float32 become float64).

* The choice: :func:`mha.api.topk.top_k` keeps what ``torch.topk`` keeps on rows full of
  ties (both of its CPU algorithms); and a layer whose indexer scores every key alike (its
  ``wq_b`` zeroed: every score is 0) matches transformers', although a lowest-index rule
  would not: the keys kept among ties are torch's.
* The gradient of the attention given the choice against torch.autograd (transformers'
  indexer runs without gradient), every weight's and the input's, to 1e-10.
* The cache of the indexer's keys: prefill then decoding past ``index_topk``, ``truncate``
  and ``reorder``, and the errors a caller can cause, by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error
from support.transformers_oracle import compare_gradients, zeroed_calls

import mha
from mha.api.sparse import IndexerSpec, SparseKVCache
from mha.api.topk import top_k
from mha.errors import AttentionTypeError, AttentionValueError, ShapeError, WeightsFileError

B, L, PREFILL = 2, 24, 10
TOLERANCE = 1e-10
FAMILIES = ("deepseek_v32", "glm_moe_dsa")

NAMES = {
    "q_a_proj.weight": ("W_q_a", True),
    "q_a_layernorm.weight": ("q_a_norm", False),
    "q_b_proj.weight": ("W_q_b", True),
    "kv_a_proj_with_mqa.weight": ("W_kv_a", True),
    "kv_a_layernorm.weight": ("kv_a_norm", False),
    "kv_b_proj.weight": ("W_kv_b", True),
    "o_proj.weight": ("W_o", True),
}
"""mha's names of transformers' latent attention parameters, and whether transposed."""


def test_top_k_keeps_what_torch_topk_keeps_among_ties(torch):
    rng = np.random.default_rng(0)
    for trial in range(1500):
        n = int(rng.choice([1, 3, 4, 5, 9, 16, 24, 64, 65, 130, 300, 1000]))
        k = int(rng.integers(1, n + 1)) if trial % 2 else int(rng.integers(1, n // 64 + 2))
        rows = rng.integers(0, int(rng.integers(1, 4)), (3, n)).astype(np.float64)
        rows[rng.random((3, n)) < 0.3] = -np.inf  # masked keys
        if trial % 3 == 0:
            rows = np.where(rng.random((3, n)) < 0.5, rows, rng.standard_normal((3, n)))
        kept = torch.tensor(rows).topk(min(k, n), dim=-1).indices.numpy()
        expected = np.zeros(rows.shape, bool)
        np.put_along_axis(expected, kept, True, axis=-1)
        assert np.array_equal(top_k(rows, k), expected), (n, k, rows.tolist())


def test_top_k_of_rows_without_ties_is_the_k_largest():
    rows = np.random.default_rng(1).standard_normal((2, 5, 40))
    kept = top_k(rows, 7)
    assert kept.sum(-1).tolist() == [[7] * 5] * 2
    assert (rows[kept].reshape(2, 5, 7).min(-1) > np.where(kept, -np.inf, rows).max(-1)).all()
    assert top_k(rows, 100).all()


def captured(family):
    """The float64 transformers model of ``family`` and each layer's ``self_attn``
    keywords in a forward over ``B`` sequences of ``L`` tokens."""
    return models.captured(family, B, L, 64)


def load(family, layer):
    return mha.LatentAttention.from_pretrained(models.saved(family), layer=layer, dtype=np.float64)


@pytest.mark.parametrize("family", FAMILIES)
def test_keys_tied_in_score_are_chosen_as_transformers_chooses(family, transformers):
    """Every score 0: which keys each query keeps is torch.topk's tie order alone."""

    model, calls = captured(family)
    module = model.model.layers[0].self_attn
    x = np.random.default_rng(2).standard_normal((B, L, 48))
    cos, sin = calls[0]["position_embeddings"]
    expected, steps = zeroed_calls(
        model, module, module.indexer.wq_b.weight, x, (cos, sin), PREFILL
    )
    attention = load(family, 0)
    attention.W_index_q[...] = 0.0
    assert relative_error(attention(x, mask=True), expected) <= 1e-12
    ours = attention.new_cache(B)
    ours = [attention(x[:, :PREFILL], cache=ours)] + [
        attention(x[:, t : t + 1], cache=ours) for t in range(PREFILL, L)
    ]
    for step, theirs in zip(ours, steps, strict=True):  # a row's length changes the ties' order
        assert relative_error(step, theirs) <= 1e-12
    assert relative_error(np.concatenate(steps, axis=1), expected) > 1e-3
    # the first k keys of each query, a lowest-index rule, would compute something else
    first = np.tri(L, dtype=bool) & (np.arange(L) < attention.indexer.topk)
    dense = mha.LatentAttention.from_spec(
        mha.LatentSpec(**{**attention.spec.__dict__, "indexer": None}), attention.parameters()
    )
    assert relative_error(dense(x, mask=first[None]), expected) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [0, 2])
def test_gradients_given_the_choice_match_autograd(
    family, layer, torch, transformers, record_error
):
    from support.rope_oracle import float64_torch

    model, calls = captured(family)
    module = model.model.layers[layer].self_attn
    g = np.random.default_rng(layer + len(family))
    x = 0.7 * g.standard_normal((B, L, 48))
    grad_out = g.standard_normal((B, L, 48))
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**calls[layer], "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()

    attention = load(family, layer)
    out, backward = attention(x, mask=True, return_backward=True)
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    grads = backward(grad_out)
    assert set(grads) == {*attention.parameters(), "query"}
    label = f"sparse {family} gradients vs autograd, float64"
    compare_gradients(module, grads, NAMES, label, record_error, TOLERANCE)
    error = relative_error(grads["query"], tx.grad.numpy())
    assert record_error(label, error) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_keeps_the_indexers_keys_through_truncate_and_reorder(family, transformers):
    attention = load(family, 1)
    x = np.random.default_rng(3).standard_normal((B, L, 48))
    cache = attention.new_cache(B, capacity=4)  # grown on the way
    assert isinstance(cache, SparseKVCache) and cache.index_keys.shape == (
        B,
        0,
        10 + 2 * (family == "deepseek_v32"),
    )
    steps = [attention(x[:, :6], cache=cache)]
    steps += [attention(x[:, t : t + 1], cache=cache) for t in range(6, L)]
    assert cache.index_keys.shape[:2] == (B, L) and cache.lengths.tolist() == [L] * B

    cache.truncate([L - 5, L - 3])  # rejected tokens, then the same tokens again
    cache.reorder([1, 0])
    again = attention(np.stack([x[1, L - 3 : L - 2], x[0, L - 5 : L - 4]]), cache=cache)
    assert relative_error(again, np.stack([steps[L - 8][1], steps[L - 10][0]])) <= 1e-13
    assert cache.lengths.tolist() == [L - 2, L - 4]


def test_a_chosen_key_set_narrower_than_the_mask_changes_the_output():
    indexer = IndexerSpec(topk=3, num_heads=2, head_dim=6)
    attention = mha.LatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12,
                                    indexer=indexer, seed=0)  # fmt: skip
    x = np.random.default_rng(4).standard_normal((2, 9, 32))
    padding = np.ones((2, 1, 9, 9), bool)
    padding[1, ..., :2] = False  # the second sequence's first two keys hidden
    out = attention(x, padding & np.tri(9, dtype=bool))
    unbatched = attention(x[0], mask=True)
    assert relative_error(unbatched, out[0]) <= 1e-15
    assert relative_error(attention(x, mask=True)[1], out[1]) > 1e-3
    big = mha.LatentAttention.from_spec(
        mha.LatentSpec(**{**attention.spec.__dict__, "indexer": IndexerSpec(9, 2, 6)}),
        attention.weights(),
    )
    dense = mha.LatentAttention.from_spec(
        mha.LatentSpec(**{**attention.spec.__dict__, "indexer": None}), attention.parameters()
    )
    assert relative_error(big(x, mask=True), dense(x, mask=True)) <= 1e-15  # top-k of all
    assert relative_error(out[0], dense(x, mask=True)[0]) > 1e-3


def test_what_sparse_attention_cannot_take_is_refused_by_name():
    indexer = IndexerSpec(topk=3, num_heads=2, head_dim=6)
    sizes = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
    attention = mha.LatentAttention(32, 4, q_lora_rank=12, indexer=indexer, seed=0, **sizes)
    x = np.zeros((2, 5, 32))
    with pytest.raises(AttentionValueError, match="needs q_lora_rank"):
        mha.LatentAttention(32, 4, indexer=indexer, **sizes)
    with pytest.raises(AttentionValueError, match="head_dim=2 is narrower"):
        mha.LatentAttention(32, 4, q_lora_rank=12, indexer=IndexerSpec(3, 2, 2), **sizes)
    with pytest.raises(AttentionTypeError, match="indexer must be None or an IndexerSpec"):
        mha.LatentAttention(32, 4, q_lora_rank=12, indexer={"topk": 3}, **sizes)
    with pytest.raises(AttentionValueError, match="topk must be"):
        mha.LatentAttention(32, 4, q_lora_rank=12, indexer=IndexerSpec(0, 2, 6), **sizes)
    plain = mha.KVCache(2, 1, 20, value_dim=16, values_in_keys=True)
    with pytest.raises(AttentionValueError, match="keeps its indexer's keys"):
        attention(x, cache=plain)
    assert plain.lengths.tolist() == [0, 0]
    with pytest.raises(AttentionValueError, match="query_lengths= is not taken by sparse"):
        attention(x, mask=True, query_lengths=[5, 3])
    with pytest.raises(ShapeError, match="one set of keys for every head"):
        attention(x, np.ones((2, 4, 5, 5), bool))
    cache = attention.new_cache(2)
    with pytest.raises(AttentionValueError, match="mask array cannot be combined with cache="):
        attention(x, np.ones((2, 1, 5, 5), bool), cache=cache)
    assert cache.lengths.tolist() == [0, 0] and cache.index_keys.shape == (2, 0, 6)


def test_a_layer_that_reuses_another_layers_choice_is_refused_by_its_index(tmp_path, transformers):
    folder = tmp_path / "glm_moe_dsa"
    shutil.copytree(models.saved("glm_moe_dsa"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["indexer_types"] = ["full", "shared", "full"]
    (folder / "config.json").write_text(json.dumps(config))
    assert mha.LatentAttention.from_pretrained(folder, layer=2).indexer.topk == 5
    with pytest.raises(AttentionValueError, match=r"indexer_types\[1\]='shared'.*cross-layer"):
        mha.LatentAttention.from_pretrained(folder, layer=1)
    del config["indexer_types"]
    config["index_topk_pattern"] = "FFS"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttentionValueError, match=r"layer 2 reuses the top-k keys"):
        mha.LatentAttention.from_pretrained(folder, layer=2)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"q_lora_rank": None}, AttentionValueError, r"q_lora_rank=null \(its indexer's queries"),
        ({"index_topk": 0}, AttentionValueError, "index_topk"),
        (
            {"index_head_dim": 4},
            WeightsFileError,
            r"indexer.wq_b.weight has shape .*index_head_dim=4",
        ),
    ],
)
def test_a_config_the_indexer_cannot_take_is_refused_by_its_key(
    change, error, message, tmp_path, transformers
):
    folder = tmp_path / "deepseek_v32"
    shutil.copytree(models.saved("deepseek_v32"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(error, match=message):
        mha.from_pretrained(folder, layer=0)
