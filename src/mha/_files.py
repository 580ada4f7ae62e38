"""Writing files atomically: a complete new file replaces the old one, or nothing changes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: Any, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, flush it to disk, give it
    the permissions a new file would get, and rename it over ``path``. If anything fails,
    or the user interrupts, the temporary file is removed and ``path`` is untouched."""
    target = Path(os.fspath(path))
    directory = target.parent if str(target.parent) else Path(".")
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115  closed below, renamed or removed
        dir=directory, prefix=f".{target.name}.", suffix=".tmp", delete=False
    )
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # mkstemp makes 0600 files
        os.replace(handle.name, target)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return target
