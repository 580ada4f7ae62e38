"""Files: written atomically, checked for writability before any work, read without pickles.

Every error names the path the caller gave, never a temporary file beside it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"


class UnreadableFileError(OSError):
    """A file that is missing or does not hold what it should; the message says why."""


def atomic_write(path: Any, write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write(handle)`` on a temporary file beside ``path``, flush it to disk, give it
    the permissions a new file would get, and rename it over ``path``. If anything fails,
    or the user interrupts, the temporary file is removed and ``path`` is untouched. An
    ``OSError`` names ``path``, not the temporary file."""
    target = Path(os.fspath(path))
    try:
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115  closed below, renamed or removed
            dir=_directory(target), prefix=f".{target.name}.", suffix=".tmp", delete=False
        )
    except OSError as error:
        raise _naming(error, target) from None
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # mkstemp makes 0600 files
        os.replace(handle.name, target)
    except OSError as error:
        Path(handle.name).unlink(missing_ok=True)
        raise _naming(error, target) from None
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return target


def writable_problem(path: Any, *, folder: bool = False) -> str | None:
    """Why ``path`` (a file, or with ``folder=True`` a folder that may not exist yet) cannot
    be written, or ``None``. It tries: a temporary file is created and removed in the folder
    that would hold the output, so read-only file systems are caught even for root."""
    target = Path(os.fspath(path))
    if folder:
        if target.exists() and not target.is_dir():
            return f"{target} is a file, not a folder"
        probe_in = target if target.is_dir() else _existing_ancestor(target)
    else:
        if target.is_dir():
            return f"{target} is a folder; give a file name"
        probe_in = _directory(target)
        if not probe_in.is_dir():
            return f"there is no folder {probe_in}"
    try:
        with tempfile.TemporaryFile(dir=probe_in):
            pass
    except OSError as error:
        return f"{probe_in} is not writable ({error.strerror or error})"
    return None


def read_arrays(path: Any, what: str) -> dict[str, np.ndarray] | np.ndarray:
    """The arrays of an ``.npz`` file (a dict) or the array of an ``.npy`` file, never
    unpickling anything. ``what`` ("an .npz file of named arrays") goes into the messages."""
    target = Path(os.fspath(path))
    try:
        with open(target, "rb") as handle:
            start = handle.read(len(NPY_MAGIC))
            handle.seek(0)
            if start.startswith(ZIP_MAGIC):
                with np.load(handle, allow_pickle=False) as data:
                    return {name: data[name] for name in data.files}
            if start.startswith(NPY_MAGIC):
                array: np.ndarray = np.load(handle, allow_pickle=False)
                return array
    except FileNotFoundError:
        raise UnreadableFileError(f"{target}: no such file") from None
    except IsADirectoryError:
        raise UnreadableFileError(f"{target} is a folder, not {what}") from None
    except Exception as error:  # a damaged archive fails in many ways (zip, npy, CRC, ...)
        reason = "it holds Python objects, which mha never unpickles"
        if "pickle" not in str(error):
            reason = f"it is damaged or truncated: {error}"
        raise UnreadableFileError(f"{target} is not {what} ({reason})") from None
    kind = "empty" if not start else "neither an .npz nor an .npy file"
    raise UnreadableFileError(f"{target} is not {what} (it is {kind})")


def _directory(target: Path) -> Path:
    return target.parent if str(target.parent) else Path(".")


def _existing_ancestor(target: Path) -> Path:
    for parent in target.absolute().parents:
        if parent.is_dir():
            return parent
    return Path("/")


def _naming(error: OSError, target: Path) -> OSError:
    """``error`` again, with the caller's path instead of a temporary file's."""
    return type(error)(error.errno or errno.EIO, error.strerror or str(error), str(target))
