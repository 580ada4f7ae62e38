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
            for member, value in vars(obj).items():
                if not member.startswith("_"):
                    yield f"{name}.{member}", value
    yield "torch_compat.multi_head_attention_forward", torch_compat.multi_head_attention_forward
    yield "plotting.plot_attention", plotting.plot_attention
    yield "dask.multi_head_attention", mha_dask.multi_head_attention
    yield "dask.scaled_dot_product_attention", mha_dask.scaled_dot_product_attention


@pytest.mark.parametrize(("name", "obj"), list(public_objects()), ids=lambda x: str(x)[:60])
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
