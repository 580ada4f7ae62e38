"""``python -m mha``: the same as the ``mha`` command."""

from .cli import entry

entry()
