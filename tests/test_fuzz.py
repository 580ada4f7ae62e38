"""The fuzzer of the public API (issue 39; tests/support/fuzz): every entry point with
every keyword, valid and invalid, classified call by call. A failure outcome fails the test
with a reproducer; the counts of calls and outcomes are printed after the run.

CI runs a fixed seed and example count (``entries.CI_EXAMPLES``, about a minute in all with
``-n 2`` on two cores). Another seed or more examples: ``MHA_FUZZ_SEED=7
MHA_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py -p no:timeout``; a long run, by time:
``python scripts/fuzz.py --minutes 15`` (docs/testing.md).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from support.fuzz import known, outcome
from support.fuzz.entries import CI_EXAMPLES, fuzzer
from support.fuzz.sdpa import check_sdpa

import mha

SEED = int(os.environ.get("MHA_FUZZ_SEED", "39"))
EXAMPLES = int(os.environ.get("MHA_FUZZ_EXAMPLES", "0"))  # per part; 0: CI_EXAMPLES's


@pytest.mark.parametrize(
    ("entry", "part"),
    [(entry, part) for entry, (_, parts) in CI_EXAMPLES.items() for part in range(parts)],
)
def test_fuzz(entry, part):
    fuzzer(entry, EXAMPLES or CI_EXAMPLES[entry][0], SEED + part)()


if known.OPEN:  # none open today: every bug the fuzzer found is fixed (known.FIXED)

    @pytest.mark.parametrize("name", sorted(known.OPEN))
    @pytest.mark.xfail(
        raises=(AssertionError, ZeroDivisionError, mha.AttentionError),
        strict=True,
        reason="a bug the fuzzer found, still open (tests/support/fuzz/known.py)",
    )
    def test_open_bug_still_reproduces(name):
        known.OPEN[name]()


@pytest.mark.parametrize("name", sorted(known.FIXED))
def test_a_fixed_bug_stays_fixed(name):
    known.FIXED[name]()


# ---------------------------------------------------- the classifier can say "failure"


def heads_call(**kwargs):
    """A plain call whose result is checked as the fuzzer checks it; ``function`` reads
    ``mha.scaled_dot_product_attention`` when called (so a test may patch it)."""
    q, k, v = np.random.default_rng(0).standard_normal((3, 1, 2, 3, 4))
    call = outcome.Call("scaled_dot_product_attention",
                        lambda *a, **kw: mha.scaled_dot_product_attention(*a, **kw),
                        (q, k, v), kwargs)  # fmt: skip
    call.check = lambda result: check_sdpa(call, result, None)
    return call


def test_the_classifier_finds_each_kind_of_failure(monkeypatch):
    real = mha.scaled_dot_product_attention
    assert outcome.classify(heads_call()).kind == "result"

    def mutates(q, k, v, **kw):
        out = real(q, k, v, **kw)
        q[0, 0, 0, 0] += 1.0
        return out

    def off(q, k, v, **kw):
        return real(q, k, v, **kw) * (1 + 1e-9)

    def raw(q, k, v, **kw):
        raise ValueError("operands could not be broadcast together")

    def warns(q, k, v, **kw):
        warnings.warn("overflow encountered in exp", RuntimeWarning, stacklevel=1)
        return real(q, k, v, **kw)

    def refuses_after_appending(q, k, v, **kw):
        real(q, k, v, **kw)  # the cache changes...
        raise mha.AttentionValueError("q is refused")  # ...and the call is refused

    cases = [
        (mutates, {}, "the call changed its input argument 0"),
        (off, {}, "wrong result: out is off the reference"),
        (raw, {}, "raised ValueError outside mha's errors"),
        (warns, {}, "a warning escaped: RuntimeWarning: overflow"),
        (refuses_after_appending, {"cache": mha.KVCache(1, 2, 4)},
         "a refused call changed cache"),
    ]  # fmt: skip
    for bad, kwargs, says in cases:
        monkeypatch.setattr(mha, "scaled_dot_product_attention", bad)
        call = heads_call(**kwargs)
        if "cache" in kwargs:
            call.refuse = frozenset({"q"})
        found = outcome.classify(call)
        assert found.kind == "failure" and says in found.detail, (bad.__name__, found.detail)
    monkeypatch.setattr(mha, "scaled_dot_product_attention", real)
    found = outcome.classify(heads_call(window=0))  # refused, but the call was valid
    assert found.kind == "failure" and "refused a valid call" in found.detail
    call = heads_call(window=0)
    call.refuse = frozenset({"window"})
    assert outcome.classify(call).kind == "refusal"
    call.refuse = frozenset({"chunk"})  # a refusal that does not name what was wrong
    assert "names none of chunk" in outcome.classify(call).detail
    call = heads_call(window=2)
    call.refuse = frozenset({"window"})  # an invalid value accepted
    assert "accepted what the contract refuses" in outcome.classify(call).detail
