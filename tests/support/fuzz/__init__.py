"""A fuzzer of mha's public API (issue 39): hypothesis strategies for every entry point and
keyword of the contract, valid and invalid values, data of every dtype and layout, the
caches' operations in random order; every call classified as a result (checked against a
dense reference written from the docs), a refusal of mha's error family naming the
argument, or a failure (:mod:`.outcome`).

``tests/test_fuzz.py`` runs it in CI with a fixed seed; ``scripts/fuzz.py`` runs it for as
long as you like (docs/testing.md). The modules: :mod:`.outcome` (the classifier),
:mod:`.tally` (the counts), :mod:`.arrays` (data, sizes, layouts), :mod:`.rules` (the dtype
rules and tolerances), :mod:`.keywords` (the contract's keywords), :mod:`.dense` (the
reference), one module per entry point (:mod:`.sdpa`, :mod:`.cached` with :mod:`.caches`,
:mod:`.serving`, :mod:`.functions`, :mod:`.layers`, :mod:`.module`), :mod:`.entries` (their
table) and :mod:`.known` (bugs found and not fixed yet).

This file imports nothing, so that ``tests/conftest.py`` can read the tallies cheaply.
"""
