"""What a layer's kept call (:mod:`.layer_plan`'s plan, :mod:`.decoding`'s step) was made
from, and the check that it still holds.

A kept call skips the checks whose answers depend on the layer's attributes alone, so it
runs only while they are what it was made from: the same names in the same order, each
attribute the very object it was (an array's shape and dtype too: they can be set in
place), and a dict, list or tuple of plain values (``rope_scaling``) equal to a copy taken
then (changed in place, it would otherwise pass). Only plain values, arrays and such
containers are held strongly; any other object weakly (an attribute that refers back to the
layer, a parent block, must not keep the layer alive through the runtime's weak dict of
kept calls), and a layer with an attribute that takes no weak reference keeps no call.
"""

from __future__ import annotations

import copy
import operator
import weakref
from typing import Any

import numpy as np

from .checks import WEIGHT_NAMES, Call

__all__ = ["LayerState", "weights_as_given"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_WEAK = object()
"""What :attr:`LayerState.strong` holds where an attribute is held weakly."""


class LayerState:
    """A layer's attributes when a kept call was made (:mod:`.kept_state`). ``keepable``
    is false where an attribute is none of: a plain value, an array, a dict, list or tuple
    of plain values (compared with a copy), an object that takes weak references."""

    def __init__(self, module: Any, call: Call) -> None:
        state = vars(module)
        self.names = tuple(state)
        strong, self.weak, self.copies, self.keepable = [], [], {}, True
        for i, (name, value) in enumerate(state.items()):
            if type(value) in _PLAIN or isinstance(value, np.ndarray | np.generic | np.dtype):
                strong.append(value)
                continue
            if _plain_container(value):
                strong.append(value)
                self.copies[name] = copy.deepcopy(value)
                continue
            strong.append(_WEAK)
            try:
                self.weak.append((i, weakref.ref(value)))
            except TypeError:  # (an object that takes no weak reference: not kept)
                self.keepable = False
        self.strong = tuple(strong)
        self.read = [x for x in vars(call.weights).values() if isinstance(x, np.ndarray)]
        self.sizes = [(x.shape, x.dtype) for x in self.read]

    def holds(self, module: Any) -> bool:
        """Whether ``module``'s attributes are still those it was made from."""
        state = vars(module)
        if tuple(state) != self.names:
            return False
        values = list(state.values())
        for i, ref in self.weak:
            if ref() is not values[i]:
                return False
            values[i] = _WEAK
        return (
            all(map(operator.is_, values, self.strong))
            and [(x.shape, x.dtype) for x in self.read] == self.sizes
            and all(state[name] == value for name, value in self.copies.items())
        )


def _plain_container(value: Any) -> bool:
    """Whether ``value`` is a dict, list or tuple holding plain values alone (in turn)."""
    if type(value) in (list, tuple):
        return all(type(x) in _PLAIN or _plain_container(x) for x in value)
    if type(value) is dict:
        return all(
            (type(x) in _PLAIN or _plain_container(x)) and type(k) in _PLAIN
            for k, x in value.items()
        )
    return False


def weights_as_given(module: Any, call: Call) -> bool:
    """Whether ``call`` holds each of the layer's weights as the layer holds it (not a
    copy the checks converted: a list, integers), so that an update in place is read."""
    weights = call.weights
    return all(getattr(weights, name, None) is getattr(module, name, None) for name in WEIGHT_NAMES)
