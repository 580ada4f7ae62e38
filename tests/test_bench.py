"""The benchmark compares like with like, and writes what the README quotes."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from support.configs import relative_error

from mha.cli import bench, measure


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
    # tiny runs say nothing they did not measure: every length for both, no 0 MiB, no
    # memory limit extrapolated from L <= 256, and labelled numbers on every log axis
    assert all("mha_peak_bytes" in r and "textbook_peak_bytes" in r
               for r in results["memory"]["rows"])  # fmt: skip
    assert "not run" not in table and "| 0 MiB" not in table and " 0 KiB" not in table
    assert "Too short to extrapolate" in table and "would run out" not in table
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = bench.chart_figure(results)
    FigureCanvasAgg(figure).draw()
    for ax in figure.axes:
        low, high = ax.get_ylim()
        shown = [
            t for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high
        ]
        assert len(shown) >= 2, [t.get_text() for t in ax.get_yticklabels()]


def test_plans():
    full, quick, smoke = bench.plan("full"), bench.plan("quick"), bench.plan("smoke")
    assert full.memory == [1024, 4096, 16384, 32768] and max(quick.memory) == 16384
    assert [shape.name for shape in full.shapes] == ["S1", "S2", "S3", "S4"]
    assert bench.steps(full) == 8 + 5 + 5
    assert smoke.repeats == 1 and full.repeats == 7 and quick.repeats == 3


@pytest.mark.parametrize("size", ["full", "quick", "smoke"])
def test_the_free_blas_child_measures_the_same_plan(size):
    """What the child of a run in a forcing environment gets (a smoke run's child once
    ran the full benchmark): arguments that make the parent's plan again."""
    parent = bench.plan(size, repeats=5)
    arguments = parent.arguments()
    child_size = next((a[2:] for a in arguments if a in ("--quick", "--smoke")), "full")
    repeats = int(arguments[arguments.index("--repeats") + 1])
    assert bench.plan(child_size, repeats) == parent


def test_runs_with_free_blas_repeats_the_run_without_the_forcing_variables(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "assert sys.argv[1:] == ['--json-only', '--quick']\n"
        "print(json.dumps({name: os.environ.get(name) for name in "
        "('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE', 'KEPT')}))\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in measure.FORCED_BLAS}
    forced = {**base, "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1000", "KEPT": "1"}
    command = [sys.executable, str(script), "--json-only", "--quick"]
    runs = measure.runs_with_free_blas(command, {"run": 1}, environ=forced)
    assert runs == [
        {"run": 1},
        {"OPENBLAS_CORETYPE": None, "OPENBLAS_L2_SIZE": None, "KEPT": "1"},
    ]
    assert forced["OPENBLAS_CORETYPE"] == "Haswell"  # only the child's environment changed
    assert measure.runs_with_free_blas(command, {"run": 1}, environ=base) == [{"run": 1}]


def test_measured_on_names_the_forcing_variables():
    env = {"date": "2026-11-30", "cores": 2, "processor": "Intel Xeon", "numpy": "2.4",
           "torch": "2.13.0", "torch_cpu_capability": "AVX512",
           "blas": [{"version": "0.3.31", "architecture": "Haswell"}]}  # fmt: skip
    held = measure.measured_on({**env, "OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1000"})
    assert "held there by OPENBLAS_CORETYPE=Haswell OPENBLAS_L2_SIZE=1000" in held
    assert "free to choose it" in measure.measured_on(env)


def test_a_run_held_to_older_instruction_sets_says_so_and_is_kept_apart(tmp_path):
    """NUMBA_CPU_NAME (the walks' target), MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA
    (torch's libraries) are named in the table's first sentence, and such a run's table is
    kept under its own name, never over the CPU's own."""
    env = {"date": "2026-12-06", "cores": 2, "processor": "AMD EPYC", "numpy": "2.4",
           "microarchitecture": "znver4", "torch": "2.13.0", "torch_cpu_capability": "AVX2",
           "numba": "0.68.1", "compiled_step": True,
           "blas": [{"version": "0.3.31", "architecture": "Haswell"}]}  # fmt: skip
    held = {**env, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma",
            "walks_avx512": False, "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}  # fmt: skip
    sentence = measure.measured_on(held)
    assert (
        "compiled by numba 0.68.1 for haswell without AVX-512 (NUMBA_CPU_NAME, "
        "NUMBA_CPU_FEATURES)." in sentence
    )
    tuned = measure.measured_on({**env, "NUMBA_CPU_NAME": "haswell", "walks_avx512": True})
    assert "for haswell with AVX-512 (NUMBA_CPU_NAME)." in tuned  # (the name: tuning alone)
    assert (
        "torch's libraries held by MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2."
        in sentence
    )
    plain = measure.measured_on(env)
    assert "compiled by numba 0.68.1. " in plain and "NUMBA_CPU_NAME" not in plain
    assert "MKL" not in plain and "held by" not in plain
    torch_only = {**env, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}  # (no name for the walks)
    for run, text in ((held, "held\n"), (env, "own\n"), (torch_only, "torch held\n")):
        measure.write(tmp_path / "benchmark.json", json.dumps({"environment": run}))
        measure.write(tmp_path / "benchmark.md", text)
        measure.keep_per_cpu(tmp_path, "benchmark")
    kept = {p.name: p.read_text() for p in tmp_path.glob("benchmark-*.md")}
    assert kept == {"benchmark-amd-epyc-znver4-as-haswell.md": "held\n",
                    "benchmark-amd-epyc-znver4.md": "own\n",
                    "benchmark-amd-epyc-znver4-held.md": "torch held\n"}  # fmt: skip


def test_this_process_records_the_variables_that_hold_instruction_sets(monkeypatch):
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    env = measure.environment(None)
    assert env["NUMBA_CPU_NAME"] == "haswell" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] is None
    assert env["walks_avx512"] in (True, False, None)  # (None: no numba)


def test_runs_on_two_cpus_of_one_name_are_kept_apart(tmp_path):
    # KVM calls a Zen 4 and a Zen 5 EPYC both "AMD EPYC": the microarchitecture tells them apart
    for micro, ms in (("znver4", 2.0), ("znver5", 1.0), (None, 3.0)):
        env = {"processor": "AMD EPYC", "microarchitecture": micro}
        measure.write(tmp_path / "decode.json", json.dumps([{"environment": env, "ms": ms}]))
        measure.write(tmp_path / "decode.md", f"{ms} ms\n")
        measure.keep_per_cpu(tmp_path, "decode")
    kept = {p.name: p.read_text() for p in tmp_path.glob("decode-*.md")}
    assert kept == {"decode-amd-epyc-znver4.md": "2.0 ms\n",
                    "decode-amd-epyc-znver5.md": "1.0 ms\n",
                    "decode-amd-epyc.md": "3.0 ms\n"}  # fmt: skip
    env = {"date": "2026-12-05", "cores": 2, "processor": "AMD EPYC", "numpy": "2.4",
           "microarchitecture": "znver4", "blas": [{"version": "0.3.31"}]}  # fmt: skip
    assert "2 cores of an AMD EPYC (znver4):" in measure.measured_on(env)


def test_a_full_run_keeps_its_table_under_the_cpus_name(tmp_path, monkeypatch):
    # mha bench (bench.command) and python -m mha.cli.bench (bench.main) both go through run
    monkeypatch.setattr(bench, "runs_with_free_blas", lambda command, results: [results])
    full = dataclasses.replace(bench.plan("smoke"), size="full")  # smoke's sizes, kept as full
    results = bench.run(full, tmp_path, None, lambda line: None)
    slug = re.sub(r"[^a-z0-9]+", "-", measure.cpu(results["environment"]).lower()).strip("-")
    kept = tmp_path / f"benchmark-{slug}.md"
    assert kept.read_text() == (tmp_path / "benchmark.md").read_text()
    bench.run(bench.plan("smoke"), tmp_path / "smoke", None, lambda line: None)
    assert not list((tmp_path / "smoke").glob("benchmark-*"))  # only full runs are kept


def test_this_machine_records_its_microarchitecture():
    micro = measure.environment(None)["microarchitecture"]
    assert micro is None or (micro and micro != "generic")
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert micro  # LLVM's name with numba, else /proc/cpuinfo's family and model


def test_json_only_prints_the_speed_table_and_the_machine(capsys):
    assert bench.main(["--json-only", "--smoke"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"environment", "speed"}
    assert [row["shape"] for row in results["speed"]] == ["tiny"] * 4
    env = results["environment"]
    assert {"instruction_sets", "numba", "compiled_step", "OPENBLAS_CORETYPE"} <= set(env)
    assert all(flag in measure.SIMD_FLAGS for flag in env["instruction_sets"])


def test_markdown_adds_the_free_blas_table(tmp_path):
    assert bench.main(["--smoke", "--output", str(tmp_path), "--no-chart"]) == 0
    results = json.loads((tmp_path / "benchmark.json").read_text())
    held = {**results["environment"], "OPENBLAS_CORETYPE": "Haswell"}
    free = {**results["environment"], "OPENBLAS_CORETYPE": None, "OPENBLAS_L2_SIZE": None}
    results["environment"] = held
    results["free_blas"] = {"environment": free, "speed": results["speed"]}
    table = bench.markdown(results)
    assert table.count("| shape | dtype |") == 2
    assert table.index("held there by OPENBLAS_CORETYPE=Haswell") < table.index("free to choose")
    assert "core: mha / torch SDPA" in table


def test_the_free_blas_child_of_the_benchmark_runs():
    forced = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
    command = [sys.executable, "-m", "mha.cli.bench", "--json-only", "--smoke"]
    first, child = measure.runs_with_free_blas(command, {"run": 1}, environ=forced)
    assert first == {"run": 1} and child["environment"]["OPENBLAS_CORETYPE"] is None
    assert [row["shape"] for row in child["speed"]] == ["tiny"] * 4


def test_finish_script_writes_results_or_prints_them_for_the_child(tmp_path, capsys, monkeypatch):
    import argparse

    def table(runs):
        return f"{len(runs)} run(s): {runs[0]['value']}\n"

    children = []

    def no_child(command, results):  # the free-BLAS child, without a process
        children.append(command)
        return [results]

    monkeypatch.setattr(measure, "runs_with_free_blas", no_child)
    args = argparse.Namespace(json_only=False, quick=True, output=tmp_path, readme=None)
    assert measure.finish_script("script.py", args, {"value": 3}, "thing", table) == 0
    assert children == [[sys.executable, "script.py", "--json-only", "--quick"]]
    assert json.loads((tmp_path / "thing-quick.json").read_text()) == [{"value": 3}]
    assert (tmp_path / "thing-quick.md").read_text() == "1 run(s): 3\n"
    assert capsys.readouterr().out == "1 run(s): 3\n\n"
    child = argparse.Namespace(json_only=True, quick=False, output=tmp_path / "none")
    assert measure.finish_script("script.py", child, {"value": 4}, "thing", table) == 0
    assert json.loads(capsys.readouterr().out) == {"value": 4}
    assert not (tmp_path / "none").exists() and len(children) == 1


def _floor_script():
    """``benchmarks/floor.py``, imported as a module (its functions, nothing run)."""
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "floor.py"
    spec = importlib.util.spec_from_file_location("floor_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_floor_times_both_blases_on_the_products_it_names(torch, dtype):
    """``floor.py`` calls NumPy's OpenBLAS and torch's BLAS at their entry points: each
    computes the row-major ``A @ B^T`` and ``A @ B`` it is timed for (shapes and row strides
    all distinct, as the tile's are not), to the products' rounding, and writes nothing
    else; with torch installed both are found (torch's x86 wheels export MKL's GEMM)."""
    gemms = _floor_script().direct_gemms(torch, dtype)
    assert set(gemms) == {"OpenBLAS", "torch's MKL" if torch.backends.mkl.is_available()
                          else "torch's BLAS"}  # fmt: skip
    rng = np.random.default_rng(0)
    M, N, K = 7, 5, 3
    A = rng.standard_normal((M, K + 2)).astype(dtype)[:, :K]  # (row strides beyond the widths)
    Bt = rng.standard_normal((N, K + 1)).astype(dtype)[:, :K]
    B = rng.standard_normal((K, N + 3)).astype(dtype)[:, :N]
    tolerance = 1e-5 if dtype == np.float32 else 1e-13
    for name, gemm in gemms.items():
        for transposed, other, expected in ((True, Bt, A @ Bt.T), (False, B, A @ B)):
            C = np.full((M, N + 4), 7.0, dtype)  # (columns past N: left alone)
            ld = [x.strides[0] // x.itemsize for x in (A, other, C)]
            gemm(transposed, M, N, K, A.ctypes.data, ld[0], other.ctypes.data, ld[1],
                 C.ctypes.data, ld[2])  # fmt: skip
            assert np.abs(C[:, :N] - expected).max() <= tolerance * np.abs(expected).max(), name
            assert (C[:, N:] == 7.0).all(), name
