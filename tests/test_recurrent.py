"""HRM's recurrent stacks (``hrm_text``, readers/recurrent.py): ``layer=i`` is cache slot
``i``, the attention of the L or H stack's layer that transformers runs in it, each slot
compared with transformers' own call of that module in that slot (``cycle_offset``) in
test_pretrained.py; here, that another slot's module would differ, that the slots are
numbered as transformers numbers them, and that what the reader does not compute is refused
by name (Doge's dynamic mask attention: test_dynamic_mask.py)."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.errors import AttentionValueError
from mha.integrations.readers.layouts import module_path, stack_slot
from mha.integrations.readers.recurrent import HRM_LAYOUT

B, L, PREFILL = 2, 24, 10


@functools.cache
def oracle():
    from support.rope_oracle import float64_rotary

    model = models.transformers_model("hrm_text")
    float64_rotary(model)
    return models.decoding_calls(model, B, L, PREFILL)


def load(slot, folder=None):
    folder = models.saved("hrm_text") if folder is None else folder
    return mha.from_pretrained(folder, layer=slot, dtype=np.float64)


def test_the_slots_are_numbered_as_transformers_runs_the_stacks():
    """transformers' cache slot of layer ``j`` in L cycle ``l`` of H cycle ``h``
    (``(h * (L_cycles + 1) + l) * per_stack + j``, the H stack's run as ``l = L_cycles``)."""
    config = {"num_layers_per_stack": 3, "H_cycles": 2, "L_cycles": 2}
    per_stack, runs = 3, 3
    for h in range(2):
        for run in range(runs):
            for j in range(per_stack):
                slot = (h * runs + run) * per_stack + j
                assert stack_slot(config, slot) == ("H" if run == 2 else "L", j)
    assert module_path(HRM_LAYOUT.path, 4, config) == "model.L_module.layers.1.attn"
    assert module_path(HRM_LAYOUT.path, 8, config) == "model.H_module.layers.2.attn"


def test_each_slot_reads_the_module_it_runs(transformers):
    """A slot computed with another stack's or layer's weights differs from transformers'
    call in that slot: the slot's module matters (the tiny model: 8 slots, L0 L1 H0 H1 twice)."""
    calls = oracle()
    assert sorted(calls) == list(range(8))
    for slot in (0, 1, 2, 3):
        x, expected = calls[slot][0]
        assert relative_error(load(slot)(x, mask=True), expected) <= 1e-12
        for other in (0, 1, 2, 3):
            if other != slot:
                assert relative_error(load(other)(x, mask=True), expected) > 1e-4, (slot, other)
    # the second H cycle runs the same modules: slot 4 + s reads slot s's weights
    for slot in range(4):
        ours, theirs = load(slot).weights(), load(slot + 4).weights()
        assert all(np.array_equal(ours[name], theirs[name]) for name in ours)


def _variant(tmp_path, change, drop=()):
    folder = shutil.copytree(models.saved("hrm_text"), tmp_path / "hrm_text")
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in drop} | change
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("change", "drop", "refusal"),
    [
        ({}, ("num_layers_per_stack",), "no num_layers_per_stack .an older config"),
        ({"num_hidden_layers": 6}, (), r"num_hidden_layers=6 for 8 cache slots"),
        ({"attention_bias": True}, (), "attention_bias=True .biases beside HRM's fused"),
    ],
)
def test_what_hrm_reads_otherwise_is_refused_by_name(tmp_path, change, drop, refusal, transformers):
    folder = _variant(tmp_path, change, drop)
    with pytest.raises(AttentionValueError, match=refusal) as error:
        load(0, folder)
    assert str(folder) in str(error.value)


def test_the_slots_default_to_the_config_class_s_cycles(tmp_path, transformers):
    """A config.json without ``H_cycles`` and ``L_cycles`` has the class's 2 and 3."""
    folder = _variant(tmp_path, {"num_hidden_layers": 16}, ("H_cycles", "L_cycles"))
    assert mha.attention_layers(folder) == list(range(16))
    reference = load(3)  # the tiny model's slot 3: H stack layer 1
    assert all(
        np.array_equal(weight, load(7, folder).weights()[name])  # slot 7 of 3 L cycles: H1
        for name, weight in reference.weights().items()
    )


def test_each_slot_decodes_with_a_paged_cache(transformers, record_error):
    """Prefill then token-by-token decoding of each slot on a paged cache of its own, against
    transformers' calls in that slot with its DynamicCache."""
    for slot, calls in oracle().items():
        attention = load(slot)
        cache = mha.PagedKVCache(
            16, 4, attention.num_kv_heads, attention.head_dim, dtype=np.float64
        )
        cache.add(0)
        cache.add(1)
        for x, expected in calls[1:]:
            error = relative_error(attention(x, cache=cache), expected)
            assert record_error("pretrained hrm_text paged decoding, float64", error) <= 1e-12
        assert cache.lengths.tolist() == [L, L]
