"""Doctests of the modules that need an extra are collected only where the extra is
installed: a module that needs an extra is never imported by collection without it (the
quick tier, ``pip install -e ".[test]"``, has none). CI installs every extra and sets
MHA_REQUIRE_NUMBA=1 and MHA_REQUIRE_DASK=1, so there nothing is left out."""

import importlib.util
import os

NEEDS_AN_EXTRA = {
    "src/mha/_kernel/_numba_step.py": ("numba", "MHA_REQUIRE_NUMBA"),  # the fast extra
    "src/mha/_kernel/_numba_walk.py": ("numba", "MHA_REQUIRE_NUMBA"),
    "src/mha/_kernel/_numba_pool.py": ("numba", "MHA_REQUIRE_NUMBA"),
    "src/mha/_kernel/_numba_stored.py": ("numba", "MHA_REQUIRE_NUMBA"),
    "src/mha/_kernel/_numba_vectors.py": ("numba", "MHA_REQUIRE_NUMBA"),
    "src/mha/_kernel/_numba_wait.py": ("numba", "MHA_REQUIRE_NUMBA"),
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
