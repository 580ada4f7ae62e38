"""Doctests of optional integrations are collected only where their library is installed
(CI installs every extra and sets MHA_REQUIRE_DASK=1, so there nothing is left out)."""

import importlib.util
import os

collect_ignore = []
if importlib.util.find_spec("dask") is None and os.environ.get("MHA_REQUIRE_DASK") != "1":
    collect_ignore.append("src/mha/integrations/dask.py")
