"""Other formats' readers and writers, as the API reaches them: by name, through this table.

The layers' loaders and exporters (``from_torch``, ``from_gpt2``, ``from_llama``,
``from_pretrained``, ``save``, ``load``, ``to_torch``) convert through functions that live
in :mod:`mha.integrations`, which builds on the API. So that imports flow one way, the
integrations register those functions here when ``mha`` is imported
(:mod:`mha.integrations.formats`), and the API looks them up by name, never importing the
integrations itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["get", "register"]

_FORMATS: dict[str, Callable[..., Any]] = {}


def register(name: str, function: Callable[..., Any]) -> None:
    """Make ``function`` the format function ``name`` (``"pretrained"``, ``"npz.save"``...)."""
    _FORMATS[name] = function


def get(name: str) -> Callable[..., Any]:
    """The format function ``name``, as :mod:`mha.integrations.formats` registered it."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise RuntimeError(
            f"no format function {name!r} is registered: import mha (which registers the "
            "integrations' readers and writers) rather than mha.api alone"
        ) from None
