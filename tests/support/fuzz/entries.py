"""The fuzzer's entry points: each a function of hypothesis's ``data`` that draws calls
and runs them (:func:`.outcome.run`), and how many examples the CI run gives it (sized
for about a minute in all with ``pytest -n 2`` on two cores; ``tests/test_fuzz.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    "scaled_dot_product_attention": 1000,
    "caches": 250,
    "multi_head_attention": 600,
    "MultiHeadAttention": 250,
    "paged_attention": 500,
    "cascade_attention": 500,
    "merge_attention": 500,
    "apply_rotary": 500,
    "alibi_slopes": 200,
}
"""Examples per entry point in CI (an example of ``caches`` or ``MultiHeadAttention`` is a
session of several calls)."""
