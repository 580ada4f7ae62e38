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
