"""Doctests of the modules that need an extra are collected only where the extra is
installed: a module that needs an extra is never imported by collection without it (the
quick tier, ``pip install -e ".[test]"``, has none). CI installs every extra and sets
MHA_REQUIRE_NUMBA=1 and MHA_REQUIRE_DASK=1, so there nothing is left out."""

import importlib.util
import os
from pathlib import Path

_HERE = Path(__file__).parent
NEEDS_AN_EXTRA = {
    **{  # the fast extra: every numba module of the kernel, those added later too
        str(path.relative_to(_HERE)): ("numba", "MHA_REQUIRE_NUMBA")
        for path in sorted((_HERE / "src/mha/_kernel").glob("_numba_*.py"))
    },
    "src/mha/integrations/dask": ("dask", "MHA_REQUIRE_DASK"),  # the dask extra
}

collect_ignore = [
    "tests/typing",  # read by the type checker, never run
    *(
        path
        for path, (package, required) in NEEDS_AN_EXTRA.items()
        if importlib.util.find_spec(package) is None and os.environ.get(required) != "1"
    ),
]
