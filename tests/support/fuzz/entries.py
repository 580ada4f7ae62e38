"""The fuzzer's entry points: each a function of hypothesis's ``data`` that draws calls
and runs them (:func:`.outcome.run`); how many examples the CI run gives it (sized for
about a minute in all with ``pytest -n 2`` on two cores; ``tests/test_fuzz.py``); and
:func:`fuzzer`, the hypothesis test of one entry point that the tests and
``scripts/fuzz.py`` run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from .caches import fuzz_cache
from .functions import alibi_calls, merge_calls, rotary_calls
from .layers import layer_calls
from .module import fuzz_module
from .outcome import run
from .sdpa import sdpa_calls
from .serving import cascade_calls, paged_calls


def one(strategy: Callable[[], Any]) -> Callable[[Any], None]:
    """An entry point that draws one call from ``strategy()`` and runs it."""

    def fuzz(data: Any) -> None:
        run(data.draw(strategy(), label="call"))

    return fuzz


ENTRIES: dict[str, Callable[[Any], None]] = {
    "scaled_dot_product_attention": one(sdpa_calls),
    "caches": fuzz_cache,
    "multi_head_attention": one(layer_calls),
    "MultiHeadAttention": fuzz_module,
    "paged_attention": one(paged_calls),
    "cascade_attention": one(cascade_calls),
    "merge_attention": one(merge_calls),
    "apply_rotary": one(rotary_calls),
    "alibi_slopes": one(alibi_calls),
}

CI_EXAMPLES = {
    "scaled_dot_product_attention": (1000, 3),
    "caches": (250, 3),
    "multi_head_attention": (600, 3),
    "MultiHeadAttention": (250, 3),
    "paged_attention": (1500, 1),
    "cascade_attention": (1500, 1),
    "merge_attention": (1500, 1),
    "apply_rotary": (1500, 1),
    "alibi_slopes": (200, 1),
}
"""Per entry point in CI: examples per part and parts, each part a test of its own with a
seed of its own (an example of ``caches`` or ``MultiHeadAttention`` is a session of
several calls)."""

UNCHECKED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
"""Hypothesis's health checks that a fuzzer's large, slow examples would trip."""


def fuzzer(entry: str, examples: int, at: int) -> Callable[[], None]:
    """The hypothesis test of ``entry``: ``examples`` examples from seed ``at``, no
    example database (a run depends on its seed alone), no deadline."""

    @seed(at)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=UNCHECKED)  # fmt: skip
    @given(st.data())
    def fuzz(data: Any) -> None:
        ENTRIES[entry](data)

    test: Callable[[], None] = fuzz
    return test
