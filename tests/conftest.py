"""Shared fixtures: the torch oracle (required in CI), and a record of the worst errors."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from support.fuzz import tally as fuzz_tally

REQUIRE_TORCH = os.environ.get("MHA_REQUIRE_TORCH") == "1"
# the model oracles (transformers): the full tier's, which sets MHA_REQUIRE_TRANSFORMERS=1
REQUIRE_TRANSFORMERS = os.environ.get("MHA_REQUIRE_TRANSFORMERS") == "1"

# Worst relative error seen per comparison family, printed at the end of the run.
WORST_ERRORS: dict[str, float] = defaultdict(float)
COMPARISONS: dict[str, int] = defaultdict(int)


@pytest.fixture(scope="session")
def torch() -> Any:
    """PyTorch for the live oracle. CI sets MHA_REQUIRE_TORCH=1, making its absence a failure."""
    try:
        import torch
    except ImportError:
        if REQUIRE_TORCH:
            pytest.fail("MHA_REQUIRE_TORCH=1 but torch cannot be imported: install torch==2.13.0")
        pytest.skip("torch is not installed: live comparisons skipped (golden fixtures still run)")
    return torch


@pytest.fixture(scope="session")
def transformers(torch: Any) -> Any:
    """Hugging Face transformers for the model oracles (the ``transformers`` extra): required
    in the full tier (MHA_REQUIRE_TRANSFORMERS=1); the torch tier runs without them."""
    try:
        import transformers
    except ImportError:
        if REQUIRE_TRANSFORMERS:
            pytest.fail("MHA_REQUIRE_TRANSFORMERS=1 but transformers cannot be imported")
        pytest.skip(
            "transformers is not installed (the transformers extra): its comparisons skipped"
        )
    return transformers


@pytest.fixture(autouse=True)
def torch_on_one_thread() -> None:
    """The oracle runs on one thread in every test, whatever an earlier test left behind.

    torch 2.13's ``logsumexp`` on two threads returned a float64 result off by 1e-9 in one
    thread's share of the rows, on its first call after mha's thread teams had run (3 full
    runs in 10 on an AVX-512 Xeon, when the benchmark test had left torch on 2 threads).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_kept_plans() -> None:
    """Each test plans its calls afresh: a plan kept in an earlier test would carry that
    test's tile sizes (mha._kernel.runtime keeps the plans and the checked keywords)."""
    from mha._kernel import runtime

    runtime.DEFAULT.forget()


@pytest.fixture
def tuned() -> Any:
    """``tuned(key_tile=64, ...)``: the runtime's thresholds changed until the test ends."""
    from contextlib import ExitStack

    from mha._kernel import runtime

    with ExitStack() as stack:
        yield lambda **changes: stack.enter_context(runtime.DEFAULT.tuned(**changes))


@pytest.fixture
def record_error() -> Any:
    """``record_error(family, error)`` keeps the worst error per family for the summary."""

    def record(family: str, error: float) -> float:
        WORST_ERRORS[family] = max(WORST_ERRORS[family], error)
        COMPARISONS[family] += 1
        return error

    return record


@pytest.fixture(scope="session")
def warm_kernel() -> None:
    """The compiled code loaded (or compiled) before a test measures memory: its first call
    allocates tens of MiB that the test would count as its own (which test runs first in a
    process depends on pytest-xdist's distribution). The tile walks, forward and backward,
    and the softmax step that masks take."""
    import mha

    for dtype in (np.float32, np.float64):
        x = np.ones((1, 1, 600, 8), dtype)
        out, backward = mha.scaled_dot_product_attention(x, x, x, causal=True, return_backward=True)
        backward(out)
        mha.scaled_dot_product_attention(x, x, x, mask=np.ones((600, 600), bool))


def pytest_sessionfinish(session: Any) -> None:
    """A pytest-xdist worker hands its errors (and the fuzzer's counts) to the controller,
    which prints the summary."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["worst_errors"] = {family: float(e) for family, e in WORST_ERRORS.items()}
        output["comparisons"] = {family: int(n) for family, n in COMPARISONS.items()}
        output["fuzz"] = fuzz_tally.exported()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The controller's side (pytest-xdist only): a finished worker's errors, merged."""
    output = getattr(node, "workeroutput", {})
    for family, worst in output.get("worst_errors", {}).items():
        WORST_ERRORS[family] = max(WORST_ERRORS[family], worst)
    for family, count in output.get("comparisons", {}).items():
        COMPARISONS[family] += count
    fuzz_tally.merge(output.get("fuzz", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = fuzz_tally.summary()
    if lines:
        terminalreporter.section("the fuzzer's calls and outcomes (tests/test_fuzz.py)")
        for line in lines:
            terminalreporter.write_line(line)
    if not WORST_ERRORS:
        return
    terminalreporter.section("worst relative error against the oracles")
    for family in sorted(WORST_ERRORS):
        terminalreporter.write_line(
            f"{family:<44} {COMPARISONS[family]:>5} comparisons   worst {WORST_ERRORS[family]:.3e}"
        )
