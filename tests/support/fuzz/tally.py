"""The fuzzer's counts: calls and outcomes per entry point, kept per process and summed
across pytest-xdist workers by ``tests/conftest.py``, which prints them after the run.

Plain dicts of ints, no NumPy and no mha: the conftest imports this module in every run.
"""

from __future__ import annotations

from collections import Counter, defaultdict

KINDS = ("result", "checked", "refusal", "failure")
"""``result``: the call returned what the docs say; ``checked``: of those, how many were
compared with the dense reference; ``refusal``: an error of mha's family naming the
argument; ``failure``: anything else (see :mod:`.outcome`)."""

TALLY: defaultdict[str, Counter[str]] = defaultdict(Counter)
"""Per entry point (``"scaled_dot_product_attention"``, ``"PagedKVCache.fork"``, ...):
``calls`` and the count of each kind."""

WORST: defaultdict[str, float] = defaultdict(float)
"""Per entry point: the worst error against the reference, relative to its tolerance
(1.0 would be at the tolerance)."""


def record(entry: str, kind: str, error: float | None = None) -> None:
    """One call of ``entry`` whose outcome is ``kind``; ``error`` is its error against the
    reference as a fraction of the tolerance (when it was checked)."""
    TALLY[entry]["calls"] += 1
    TALLY[entry][kind] += 1
    if error is not None:
        TALLY[entry]["checked"] += 1
        WORST[entry] = max(WORST[entry], error)


def exported() -> dict[str, dict[str, float]]:
    """The counts as plain data (a pytest-xdist worker hands them to the controller)."""
    data: dict[str, dict[str, float]] = {entry: dict(counts) for entry, counts in TALLY.items()}
    for entry, worst in WORST.items():
        data[entry]["worst"] = worst
    return data


def merge(data: dict[str, dict[str, float]]) -> None:
    """Add a worker's :func:`exported` counts to this process's."""
    for entry, counts in data.items():
        for kind, n in counts.items():
            if kind == "worst":
                WORST[entry] = max(WORST[entry], n)
            else:
                TALLY[entry][kind] += int(n)


def summary() -> list[str]:
    """The lines printed after a run: one per entry point, then the totals."""
    if not TALLY:
        return []
    head = f"{'entry point':<44} {'calls':>8} {'results':>8} {'checked':>8} {'refusals':>8}"
    lines = [f"{head} {'failures':>8}  worst/tol"]
    total: Counter[str] = Counter()
    for entry in sorted(TALLY):
        counts = TALLY[entry]
        total.update(counts)
        worst = f"{WORST[entry]:.2e}" if entry in WORST else "-"
        lines.append(
            f"{entry:<44} {counts['calls']:>8} {counts['result']:>8} {counts['checked']:>8} "
            f"{counts['refusal']:>8} {counts['failure']:>8}  {worst}"
        )
    lines.append(
        f"{'all':<44} {total['calls']:>8} {total['result']:>8} {total['checked']:>8} "
        f"{total['refusal']:>8} {total['failure']:>8}"
    )
    return lines
