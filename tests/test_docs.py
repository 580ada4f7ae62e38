"""Every public function, class and method shows an example that the suite runs."""

from __future__ import annotations

import inspect

import pytest

import mha
from mha import dask as mha_dask
from mha import torch_compat
from mha.cli import plots as plotting


def public_objects():
    for name in mha.__all__:
        obj = getattr(mha, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            continue  # the exception classes are shown in mha.errors' module example
        yield name, obj
        if inspect.isclass(obj):
            for member, value in vars(obj).items():  # methods and properties: a spec's
                if not member.startswith("_") and (
                    callable(value) or isinstance(value, (property, classmethod, staticmethod))
                ):  # fields are data
                    yield f"{name}.{member}", value
    yield "torch_compat.multi_head_attention_forward", torch_compat.multi_head_attention_forward
    yield "plotting.plot_attention", plotting.plot_attention
    yield "dask.multi_head_attention", mha_dask.multi_head_attention
    yield "dask.scaled_dot_product_attention", mha_dask.scaled_dot_product_attention


@pytest.mark.parametrize(
    ("name", "obj"), [pytest.param(*pair, id=pair[0]) for pair in public_objects()]
)
def test_public_docstrings_have_examples(name, obj):
    target = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
    assert ">>>" in (inspect.getdoc(target) or ""), f"{name} has no example"


def test_the_algorithm_page_covers_its_topics():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "algorithm.md").read_text()
    for heading in ("Projections and heads", "stable softmax", "Masks", "online softmax",
                    "Threads and BLAS", "Merging partial results", "Grouped-query attention",
                    "Sliding windows", "The KV cache", "Split-key decoding"):  # fmt: skip
        assert heading in text


def test_the_variants_page_writes_the_built_ins_as_mods():
    """docs/variants.md's mask_mods and score_mods give what the built-in keywords give."""
    import re
    from pathlib import Path

    import numpy as np

    text = (Path(__file__).parent.parent / "docs" / "variants.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    (block,) = [b for b in blocks if "def causal" in b]
    page: dict = {"mha": mha}
    exec(compile(block, "docs/variants.md", "exec"), page)
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 1, 8, 4096, 8))
    i, j = np.arange(4096)[:, None], np.arange(4096)[None]

    def attend(**keywords):
        return mha.scaled_dot_product_attention(q, k, v, **keywords)

    def close(a, b):
        return np.abs(a - b).max() <= 1e-13 * np.abs(b).max()

    assert close(attend(mask_mod=page["causal"]), attend(causal=True))
    assert close(attend(mask_mod=page["sliding"]), attend(causal=True, window=256))
    assert close(attend(causal=True, score_mod=page["alibi"]), attend(causal=True, alibi=True))
    capped = attend(causal=True, score_mod=page["softcap"], score_mod_grad=page["softcap_grad"])
    assert close(capped, attend(causal=True, softcap=30.0))
    doc = page["doc"]
    assert close(attend(mask_mod=page["document_causal"]),
                 attend(mask=(doc[i] == doc[j]) & (i >= j)))  # fmt: skip
    assert close(attend(mask_mod=page["prefix_lm"]), attend(mask=(j < 128) | (i >= j)))
