"""The benchmark compares like with like, and writes what the README quotes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.configs import relative_error

from mha.cli import bench


@pytest.mark.parametrize("causal", [False, True])
def test_textbook_baseline_computes_the_same_function(causal):
    case = bench.Case(bench.Shape("t", B=2, L=24, d_model=32, H=4, causal=causal), np.float64, None)
    assert relative_error(case.textbook(), case.mha()) <= 1e-12


def test_torch_baseline_computes_the_same_function(torch):
    shape = bench.Shape("t", B=2, L=24, d_model=32, H=4, causal=True)
    case = bench.Case(shape, np.float64, torch)
    assert relative_error(case.torch_mha(), case.mha()) <= 1e-12


def test_flops_count_only_visible_pairs():
    full = bench.Shape("f", B=1, L=4, d_model=8, H=2, causal=False)
    causal = bench.Shape("c", B=1, L=4, d_model=8, H=2, causal=True)
    assert full.flops() == 8 * 4 * 64 + 4 * 2 * 16 * 4
    assert causal.flops() == 8 * 4 * 64 + 4 * 2 * 10 * 4


def test_main_writes_json_markdown_and_the_readme_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.BEGIN}\nold table\n{bench.END}\noutro\n")
    assert bench.main(["--smoke", "--output", str(tmp_path / "out"), "--readme", str(readme)]) == 0
    results = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert [row["shape"] for row in results["speed"]] == ["tiny"] * 4
    assert {row["L"] for row in results["memory"]["rows"]} == {128, 256}
    assert all(row["relative_error_vs_reference"] < 1e-5 for row in results["speed"])
    table = (tmp_path / "out" / "benchmark.md").read_text()
    assert "| tiny causal (B=1, L=128, d=32, H=4) | float64 |" in table
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert table in text
    assert (tmp_path / "out" / "benchmark.png").stat().st_size > 0


def test_plans():
    full, quick, smoke = bench.plan("full"), bench.plan("quick"), bench.plan("smoke")
    assert full.memory == [1024, 4096, 16384, 32768] and max(quick.memory) == 16384
    assert [shape.name for shape in full.shapes] == ["S1", "S2", "S3", "S4"]
    assert bench.steps(full) == 8 + 5 + 5
    assert smoke.repeats == 1 and full.repeats == 7 and quick.repeats == 3
