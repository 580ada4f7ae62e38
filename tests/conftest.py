"""Shared fixtures: the torch oracle (required in CI), and a record of the worst errors."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest

REQUIRE_TORCH = os.environ.get("MHA_REQUIRE_TORCH") == "1"

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
    torch.set_num_threads(1)
    return torch


@pytest.fixture
def record_error() -> Any:
    """``record_error(family, error)`` keeps the worst error per family for the summary."""

    def record(family: str, error: float) -> float:
        WORST_ERRORS[family] = max(WORST_ERRORS[family], error)
        COMPARISONS[family] += 1
        return error

    return record


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not WORST_ERRORS:
        return
    terminalreporter.section("worst relative error against the oracles")
    for family in sorted(WORST_ERRORS):
        terminalreporter.write_line(
            f"{family:<44} {COMPARISONS[family]:>5} comparisons   worst {WORST_ERRORS[family]:.3e}"
        )
