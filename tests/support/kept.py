"""Spies on a layer's kept calls (:mod:`mha.api.decoding`'s step, :mod:`mha.api.layer_plan`'s
plan), shared by their tests."""

from __future__ import annotations

from typing import Any


def taken(monkeypatch: Any, kind: type) -> list[int]:
    """A list that grows by one each time a kept call of ``kind`` computes a call itself
    (returns other than ``None``)."""
    calls: list[int] = []
    real = kind.__call__

    def spied(*args: Any) -> Any:
        out = real(*args)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(kind, "__call__", spied)
    return calls


def same_in_threads(calls: list[Any], times: int = 50) -> None:
    """Each of ``calls`` (functions of no arguments returning an array) run ``times`` times
    in a thread of its own, all at once: every result bit for bit what the call gave alone
    (a kept call shared between threads keeps each call's own input and buffers)."""
    import threading

    import numpy as np

    alone = [call() for call in calls]
    got: list[list[Any]] = [[] for _ in calls]

    def run(i: int) -> None:
        for _ in range(times):
            got[i].append(calls[i]())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for outs, expected in zip(got, alone, strict=True):
        assert len(outs) == times
        for out in outs:
            np.testing.assert_array_equal(out, expected)
