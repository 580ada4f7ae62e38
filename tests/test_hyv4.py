"""HY-V4's latent attention (:mod:`mha.integrations.readers.hyv4`): DeepSeek-V3.2's sparse
top-k attention with a sigmoid gate per feature, a learned sink a head, an indexer rotating
its last features, and ``"shared"`` layers that attend with an earlier layer's choice of keys
(``shares_choice_with``), against transformers' own layers.

The layers are those of the tiny checkpoint of support.pretrained_models (``index_topk`` 4
of 24 positions; layer 1 reuses layer 0's choice), loaded by transformers in float64 with
the float64 rotary of support.rope_oracle; a pre-hook captures the keywords each
``self_attn`` gets in a model forward (its rotary, its causal mask, and for layer 1 the
``prev_topk_indices`` of layer 0), and the layer is called again with them under
``float64_torch``. Layer by layer, whole sequences and decoding are compared in
test_pretrained.py; here: every gradient given the choice against torch.autograd (1e-10),
the choice a shared layer is given, and the errors a caller can cause, by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error
from support.transformers_oracle import compare_gradients

import mha
from mha.api.sparse import IndexerSpec, SparseKVCache
from mha.errors import AttentionValueError, ShapeError

B, L, PREFILL = 2, 24, 10
TOLERANCE = 1e-10
FAMILY = "hy_v4"

NAMES = {
    "q_a_proj.weight": ("W_q_a", True),
    "q_a_proj.bias": ("b_q_a", False),
    "q_a_layernorm.weight": ("q_a_norm", False),
    "q_b_proj.weight": ("W_q_b", True),
    "kv_a_proj_with_mqa.weight": ("W_kv_a", True),
    "kv_a_proj_with_mqa.bias": ("b_kv_a", False),
    "kv_a_layernorm.weight": ("kv_a_norm", False),
    "kv_b_proj.weight": ("W_kv_b", True),
    "o_proj.weight": ("W_o", True),
    "o_proj.bias": ("b_o", False),
    "gate_proj.weight": ("W_g", True),
    "sinks": ("sinks", False),
}
"""mha's names of transformers' HY-V4 attention parameters, and whether transposed."""


def captured():
    """The float64 transformers model and each layer's ``self_attn`` keywords in a forward
    over ``B`` sequences of ``L`` tokens."""
    return models.captured(FAMILY, B, L, 64)


def load(layer):
    return mha.LatentAttention.from_pretrained(models.saved(FAMILY), layer=layer, dtype=np.float64)


def chosen_by_transformers(indices):
    """The keys transformers' ``topk_indices (B, L, k)`` let each query attend to (ANDed
    with the causal mask, as its attention mask keeps them): ``(B, L, L)``."""
    chosen = np.zeros((B, L, L), bool)
    np.put_along_axis(chosen, np.asarray(indices, dtype=np.int64), True, axis=-1)
    return chosen & np.tri(L, dtype=bool)


def test_the_layers_read_are_what_the_config_says(transformers):
    sparse, shared = load(0), load(1)
    assert sparse.indexer == IndexerSpec(4, 3, 12, norm_eps=2.0, rotate_last=True)
    assert sparse.shares_choice_with is None and sparse.sinks.shape == (4,)
    assert shared.indexer is None and shared.shares_choice_with == 0
    assert not sparse.output_gate_per_head and sparse.W_g.shape == (48, 4 * 10)
    assert load(2).indexer is not None
    assert type(sparse.new_cache(B)) is SparseKVCache and type(shared.new_cache(B)) is mha.KVCache


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_gradients_given_the_choice_match_autograd(layer, torch, transformers, record_error):
    """Every weight's gradient (the gate's and the sinks' among them) and the input's, for
    layers choosing their keys (0, 2) and the layer reusing layer 0's choice (1)."""
    from support.rope_oracle import float64_torch

    model, calls = captured()
    module = model.model.layers[layer].self_attn
    keywords = {**calls[layer], "cache": None}
    g = np.random.default_rng(layer + 7)
    x = 0.7 * g.standard_normal((B, L, 48))
    grad_out = g.standard_normal((B, L, 48))
    module.zero_grad(set_to_none=True)
    tx = torch.tensor(x, requires_grad=True)
    with float64_torch():
        expected = module(**{**keywords, "hidden_states": tx})[0]
        (expected * torch.tensor(grad_out)).sum().backward()

    attention = load(layer)
    mask = True
    if layer == 1:  # the choice layer 0 made in the model's forward
        assert keywords["prev_topk_indices"] is not None
        mask = chosen_by_transformers(keywords["prev_topk_indices"])
    out, backward = attention(x, mask=mask, return_backward=True)
    assert relative_error(out, expected.detach().numpy()) <= 1e-12
    grads = backward(grad_out)
    assert set(grads) == {*attention.parameters(), "query"}
    assert {"W_g", "sinks"} <= set(grads)
    label = f"sparse {FAMILY} gradients vs autograd, float64"
    compare_gradients(module, grads, NAMES, label, record_error, TOLERANCE)
    error = relative_error(grads["query"], tx.grad.numpy())
    assert record_error(label, error) <= TOLERANCE


def test_a_shared_layer_attends_with_the_choice_of_its_chooser(transformers):
    """The choice a cache records is the keys its layer attended to: layer 1 given layer 0's
    computes transformers' layer 1; the layer's call without it is refused by name."""
    from support.rope_oracle import float64_torch

    model, calls = captured()
    chooser, shared = load(0), load(1)
    cache = chooser.new_cache(B)
    chooser(calls[0]["hidden_states"].numpy(), cache=cache)
    assert cache.chosen.shape == (B, L, L) and not cache.chosen.flags.writeable
    assert cache.chosen.sum(-1).max() == 4  # index_topk of the 24 keys
    expected = chosen_by_transformers(calls[1]["prev_topk_indices"])
    assert np.array_equal(cache.chosen, expected)
    with float64_torch():
        module = model.model.layers[1].self_attn
        theirs = module(**{**calls[1], "cache": None})[0].detach().numpy()
    x = calls[1]["hidden_states"].numpy()
    assert relative_error(shared(x, mask=cache.chosen), theirs) <= 1e-12
    assert relative_error(shared(x, mask=np.tri(L, dtype=bool)[None]), theirs) > 1e-3
    for mask in (None, True):
        with pytest.raises(AttentionValueError, match="reuses that layer's top-k choice"):
            shared(x, mask=mask)


def test_what_a_caller_can_get_wrong_is_refused_by_name():
    sizes = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3}
    with pytest.raises(AttentionValueError, match="has no indexer of its own"):
        mha.LatentAttention(
            16, 2, q_lora_rank=6, indexer=IndexerSpec(2, 1, 4), shares_choice_with=0, **sizes
        )
    with pytest.raises(AttentionValueError, match="shares_choice_with"):
        mha.LatentAttention(16, 2, shares_choice_with=-1, **sizes)
    gated = mha.LatentAttention(
        16, 2, output_gate="sigmoid", output_gate_per_head=False, sinks=True, **sizes
    )
    assert gated.W_g.shape == (16, 6) and np.array_equal(gated.sinks, np.zeros(2))
    assert "sinks=True" in repr(gated) and "output_gate_per_head=False" in repr(gated)
    weights = {**gated.weights(), "W_g": np.zeros((16, 2))}
    with pytest.raises(ShapeError, match=r"W_g has shape .* one gate a feature"):
        mha.LatentAttention.from_spec(gated.spec, weights)
    with pytest.raises(ShapeError, match="sinks has shape"):
        mha.LatentAttention.from_spec(gated.spec, {**gated.weights(), "sinks": np.zeros(3)})


def test_save_and_load_keep_the_new_settings(tmp_path, transformers):
    for layer in (0, 1):
        attention = load(layer)
        attention.save(tmp_path / f"{layer}.npz")
        again = mha.LatentAttention.load(tmp_path / f"{layer}.npz")
        assert again.spec == attention.spec
        for name, weight in attention.weights().items():
            assert (weight is None) == (again.weights()[name] is None), name
            assert weight is None or np.array_equal(weight, again.weights()[name]), name


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        (["shared", "full", "full"], r"indexer_types\[0\]='shared' and no 'full' layer before"),
        (["full", "sometimes", "full"], r"indexer_types\[1\]='sometimes' \(an indexer is"),
    ],
)
def test_indexer_types_a_layer_cannot_follow_are_refused_by_its_index(
    kinds, message, tmp_path, transformers
):
    folder = shutil.copytree(models.saved(FAMILY), tmp_path / FAMILY)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "indexer_types": kinds}))
    layer = kinds.index(next(kind for kind in kinds if kind != "full"))
    with pytest.raises(AttentionValueError, match=message) as error:
        mha.from_pretrained(folder, layer=layer)
    assert str(folder) in str(error.value)


def test_without_indexer_types_the_config_classs_pattern_is_read(tmp_path, transformers):
    """Layer 0 and every fourth from layer 1 choose, the others reuse the last choice: of
    this checkpoint's ["full", "shared", "full"], layer 1 would then need an indexer and
    layer 2 none."""
    folder = shutil.copytree(models.saved(FAMILY), tmp_path / FAMILY)
    config = json.loads((folder / "config.json").read_text())
    del config["indexer_types"]
    (folder / "config.json").write_text(json.dumps(config))
    assert mha.from_pretrained(folder, layer=0).indexer is not None
    with pytest.raises(mha.WeightsFileError, match=r"lacks indexer\.k_norm\.bias"):
        mha.from_pretrained(folder, layer=1)
    with pytest.raises(mha.WeightsFileError, match=r"does not have: indexer\.k_norm\.bias"):
        mha.from_pretrained(folder, layer=2)
