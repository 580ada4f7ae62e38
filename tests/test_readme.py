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


def test_the_tour_runs():
    namespace: dict = {}
    exec(compile(blocks("python")[0], "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 5, 8)
    assert namespace["weights"].shape == (2, 2, 5, 5)


def test_the_interop_example_runs(torch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks("python")[1], "README.md", "exec"), namespace)
    np.testing.assert_allclose(namespace["out2"].transpose(1, 0, 2), namespace["attention"](
        namespace["x"]), rtol=1e-5, atol=1e-6)  # fmt: skip
    assert namespace["weights"].shape == (2, 5, 5)
    assert len(blocks("python")) == 7


def test_the_decoding_example_runs(capsys):
    namespace: dict = {}
    exec(compile(blocks("python")[2], "README.md", "exec"), namespace)
    assert capsys.readouterr().out.strip() == "[8 6]"
    cache = namespace["cache"]
    assert cache.lengths.tolist() == [6, 7] and namespace["out"].shape == (2, 1, 64)


def test_the_serving_example_runs(capsys):
    """Two forks of a shared prompt: the blocks held are the prompt's three, and one copy
    (the first fork to write into the shared, half-full third block)."""
    namespace: dict = {}
    exec(compile(blocks("python")[3], "README.md", "exec"), namespace)
    assert capsys.readouterr().out.strip() == "[41 41] 1020"
    pool = namespace["pool"]
    tables = pool.block_table()
    assert (tables[0, :2] == tables[1, :2]).all() and tables[0, 2] != tables[1, 2]
    x = namespace["x"]
    alone = mha.scaled_dot_product_attention(x[None, :, :41], x[None, :2, :41], x[None, :2, :41],
                                             causal=True)[:, :, -1:]  # fmt: skip
    np.testing.assert_allclose(namespace["out"], np.repeat(alone, 2, 0), rtol=1e-6)


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
                 '".[test,torch,fast,dask]" && MHA_REQUIRE_TORCH=1 MHA_REQUIRE_NUMBA=1 '
                 "MHA_REQUIRE_DASK=1 pytest -n auto"):  # fmt: skip
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


def test_the_variants_example_runs(capsys):
    """The example's sinks gradient is the dense formula's, and its document mask is the
    boolean mask it stands for."""
    namespace: dict = {}
    exec(compile(blocks("python")[4], "README.md", "exec"), namespace)
    assert capsys.readouterr().out.strip() == "(8,) (1, 8, 256, 64)"
    q, k, v, doc = (namespace[name] for name in ("q", "k", "v", "doc"))
    i, j = np.arange(256)[:, None], np.arange(256)[None]
    dense = mha.scaled_dot_product_attention(q, k, v, mask=(doc[i] == doc[j]) & (i >= j))
    np.testing.assert_allclose(namespace["packed"], dense, rtol=1e-13, atol=1e-13)
    s = np.where((j <= i) & (i - j < 128), q @ k.swapaxes(-1, -2) / 8.0, -np.inf)
    lse = np.logaddexp(np.logaddexp.reduce(s, axis=-1), 0.0)  # the sinks are 0
    out = np.exp(s - lse[..., None]) @ v
    # d out / d sink = -exp(sink - lse) * out; grad_out is ones
    expected = -(np.exp(0.0 - lse) * out.sum(axis=-1)).sum(axis=(0, 2))
    np.testing.assert_allclose(namespace["grads"]["sinks"], expected, rtol=1e-11)


def test_the_gradients_example_runs():
    namespace: dict = {}
    exec(compile(blocks("python")[5], "README.md", "exec"), namespace)
    attention, grads = namespace["attention"], namespace["grads"]
    assert set(grads) == {*attention.parameters(), "query", "key", "value"}
    assert grads["W_q"].shape == attention.W_q.shape
    # dX, the sum of the three, is the gradient of sum(out) in X: central differences on
    # the module as it was before the example's step (same seed, same weights)
    X, before = namespace["X"], mha.MultiHeadAttention(16, 4, bias=True, seed=0)
    rng = np.random.default_rng(1)
    for index in zip(*(rng.integers(0, n, 4) for n in X.shape), strict=True):
        step = np.zeros_like(X)
        step[index] = 1e-6
        numeric = (before(X + step, mask=True).sum() - before(X - step, mask=True).sum()) / 2e-6
        assert abs(numeric - namespace["dX"][index]) <= 1e-6 * max(1.0, abs(numeric))
