"""What a test does when an optional extra it needs is missing: where CI asks for the extra
(``MHA_REQUIRE_NUMBA=1``, set by every tier that installs numba), a missing extra fails the
test; elsewhere (the core tier, which installs no extra by design) the test is skipped,
saying what runs instead."""

from __future__ import annotations

import os

import pytest


def needs_numba(available: bool, instead: str) -> None:
    """Fail (under ``MHA_REQUIRE_NUMBA=1``) or skip unless the compiled code is
    ``available``; ``instead``: what runs without it."""
    if available:
        return
    if os.environ.get("MHA_REQUIRE_NUMBA") == "1":
        pytest.fail(f"MHA_REQUIRE_NUMBA=1 but the compiled code is unavailable ({instead})")
    pytest.skip(f"numba is not installed (or MHA_COMPILED=0): {instead}")
