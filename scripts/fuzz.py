"""Run the fuzzer of the public API (tests/support/fuzz) for a while and print its tallies.

    python scripts/fuzz.py --minutes 15              # every entry point, seeds 1000 on
    python scripts/fuzz.py --calls 300000 --jobs 2   # until that many calls, two processes
    python scripts/fuzz.py --minutes 5 --entries caches,merge_attention --seed 7

The same strategies and classifier as tests/test_fuzz.py, in rounds: each round runs every
entry point chosen for its CI share of examples (tests/support/fuzz/entries.py) from a
seed of its own, until the time or the count of calls is reached. A failure ends its
round (hypothesis shrinks it first) and is printed with its reproducer; the run goes on
with the next round. Exit status 1 if there was any failure. Run it in the mha checkout,
with mha importable (``pip install -e .``, or ``PYTHONPATH=src``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support.fuzz import tally  # noqa: E402

ROUND = 0.2
"""A round is this fraction of an entry point's CI examples: short enough to stop on time."""


def fuzz_for(entries: list[str], start: int, stride: int, until: float, calls: int) -> Any:
    """Rounds from seed ``start`` (every ``stride``-th) until time ``until`` or ``calls``
    calls (in this process): the tallies and the failures' messages."""
    from support.fuzz.entries import CI_EXAMPLES, fuzzer

    failures: list[str] = []
    at = start
    while time.time() < until and total_calls() < calls:
        for entry in entries:
            examples = max(1, int(CI_EXAMPLES[entry][0] * ROUND))
            try:
                fuzzer(entry, examples, at)()
            except Exception as error:  # a failure outcome, shrunk: note it, go on
                failures.append(f"{entry}, seed {at}:\n{described(error)}")
            if time.time() >= until or total_calls() >= calls:
                break
        at += stride
    return tally.exported(), failures


def described(error: BaseException) -> str:
    """An error's message and hypothesis's notes (the drawn example), each failure of a
    group of them."""
    parts = getattr(error, "exceptions", [error])
    return "\n---\n".join(
        "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])]) for e in parts
    )


def total_calls() -> int:
    return sum(counts["calls"] for counts in tally.TALLY.values())


def main() -> int:
    from support.fuzz.entries import ENTRIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="stop after (default 15)")
    parser.add_argument("--calls", type=int, default=10**9, help="or after this many calls")
    parser.add_argument("--seed", type=int, default=1000, help="the first round's seed")
    parser.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--entries", default=",".join(ENTRIES),
                        help="comma-separated entry points (default: all)")  # fmt: skip
    args = parser.parse_args()
    entries = args.entries.split(",")
    unknown = sorted(set(entries) - set(ENTRIES))
    if unknown:
        parser.error(f"unknown entry points {unknown}; choose from {sorted(ENTRIES)}")
    began = time.time()
    until = began + 60 * args.minutes
    share = -(-args.calls // args.jobs)
    failures: list[str] = []
    if args.jobs == 1:
        _, failures = fuzz_for(entries, args.seed, 1, until, share)
    else:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            runs = [pool.submit(fuzz_for, entries, args.seed + job, args.jobs, until, share)
                    for job in range(args.jobs)]  # fmt: skip
            for run in runs:
                counts, found = run.result()
                tally.merge(counts)
                failures += found
    for failure in failures:
        print(f"\n=== FAILURE in {failure}\n")
    print(f"\nThe fuzzer's calls and outcomes: {time.time() - began:.0f} s, seeds from "
          f"{args.seed}, {args.jobs} process(es)\n")  # fmt: skip
    print("\n".join(tally.summary()))
    print(f"\n{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
