"""numba code of :mod:`mha._kernel.compiled`'s wait for a helper's next job; importing it
needs numba."""

from __future__ import annotations

from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _read(typingctx, signal):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``signal[0]`` (int64) read afresh from memory each time (an atomic load, which the
    compiler cannot move out of a loop), with acquire ordering."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(array.data, "acquire", 8)

    return types.int64(signal), codegen


@njit(nogil=True, cache=True)
def wait(signal, seen, rounds):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Whether ``signal[0]`` changes from ``seen`` within ``rounds`` reads, without the GIL."""
    for _ in range(rounds):  # noqa: SIM110 (a loop numba compiles)
        if _read(signal) != seen:
            return True
    return False
