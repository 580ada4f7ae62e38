"""The census of transformers' causal language models (support.census): every ``model_type``
of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, enumerated from transformers itself,
is classified, and ``mha.from_pretrained`` on a tiny random checkpoint of it either reads
every attention layer as transformers computes it (within 1e-12, whole sequences and
decoding) or refuses it by the feature that blocks it. None is computed wrongly; none is
refused by a message that names no feature, but for the families of :data:`GENERIC`, which
this test keeps exact (a family read or refused by name leaves it); the families read only
grow (:data:`READ_AT_LEAST`). And :func:`mha.from_pretrained`, the one entry point that
returns whichever attention a layer computes.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from support import census
from support import pretrained_models as models
from support.configs import relative_error

import mha
from mha.integrations import readers

READ_AT_LEAST = 131
"""The families read today: a change that reads fewer fails (raise it as rows are added)."""

GENERIC: frozenset[str] = frozenset()
"""The families still refused by ``model_type`` alone ("it is not supported"): those whose
attention mha may compute once a row reads it, and those whose feature is not named yet."""


@functools.cache
def entry(family):
    return census.entry(family)


def test_the_census_classifies_every_causal_lm_of_transformers(transformers):
    """A family added upstream fails here until the census classifies it (and one removed
    upstream, until it leaves the census)."""
    mapping = set(census.causal_lm_types())
    assert mapping - set(census.CLASSES) == set(), "unclassified: add them to census.CLASSES"
    assert set(census.CLASSES) - mapping == set(), "no longer in transformers' mapping"


@pytest.mark.parametrize("family", sorted(census.CLASSES))
def test_each_family_is_read_exactly_or_refused_by_its_feature(family, transformers, record_error):
    item = entry(family)
    assert item.result != census.CANNOT_BUILD, f"the census cannot build {family}: {item.detail}"
    assert item.result != census.WRONG, f"{family} is read but differs by {item.error:.2e}"
    if item.result == census.READ:
        record_error("census, float64", item.error)
    if family in readers.FAMILIES:
        assert item.result == census.READ, item.detail
    assert item.generic == (family in GENERIC), (
        f"{family}: {item.result}: {item.detail}; update GENERIC"
    )
    if census.CLASSES[family] != census.DECODER:  # refused as what it is
        assert item.result == census.REFUSED, item.detail
        assert any(what in item.detail for what in ("decoder-only", "multimodal", "no attention"))


def test_the_families_read_only_grow(transformers):
    read = set(readers.FAMILIES) & set(census.CLASSES)
    assert len(read) >= READ_AT_LEAST, sorted(read)
    assert not GENERIC & read, "read families must leave GENERIC"
    assert set(GENERIC) <= set(census.CLASSES)


def test_the_census_catches_a_layer_read_wrongly(monkeypatch, transformers):
    """Mistral read without its window: the census finds it wrong, not read."""
    changed = models.changed(readers.layer_attention, {"window": None})
    monkeypatch.setattr(readers, "layer_attention", changed)
    item = census.entry("mistral")
    assert item.result == census.WRONG and item.error > 1e-4, item


def test_the_refusals_named_are_of_families_not_read():
    assert not set(readers.REFUSED) & set(readers.FAMILIES)


@pytest.mark.parametrize(
    ("family", "kind"),
    [("llama", mha.MultiHeadAttention), ("deepseek_v3", mha.LatentAttention)],
)
def test_from_pretrained_returns_the_attention_each_layer_computes(family, kind, transformers):
    """The one entry point gives the classmethods' layer, of whichever kind it is, weight for
    weight and output for output."""
    folder = models.saved(family)
    x = np.random.default_rng(0).standard_normal((2, 7, 48))
    for layer in range(3):
        attention = mha.from_pretrained(folder, layer=layer, dtype=np.float64)
        assert type(attention) is kind
        expected = kind.from_pretrained(folder, layer=layer, dtype=np.float64)
        assert attention.weights().keys() == expected.weights().keys()
        for name, weight in attention.weights().items():
            assert np.array_equal(weight, expected.weights()[name]), name
        assert relative_error(attention(x, mask=True), expected(x, mask=True)) == 0.0
    with pytest.raises(mha.AttentionValueError, match="layer=3 is out of range"):
        mha.from_pretrained(folder, layer=3)
