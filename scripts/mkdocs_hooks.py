"""MkDocs hooks for the documentation site (mkdocs.yml): docstrings' doctests shown as code.

mha's docstrings carry their examples as bare doctests (``>>>`` lines and their output), which
the test suite runs. Markdown would read them as paragraphs, and ``[8192, 2304]`` in an output
as a link; this preprocessor fences each run of doctest lines as a ``pycon`` code block first,
and shows Sphinx's cross-reference roles (``:func:`name```) as the code they name.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

FENCE = re.compile(r"^\s*(```|~~~)")
PROMPT = re.compile(r"^(\s*)>>> ")
ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class DoctestFences(Preprocessor):
    """Fence every doctest (from its first ``>>>`` line to the next blank line) outside the
    code blocks a page already fences."""

    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fenced = False
        doctest_indent: str | None = None
        for line in lines:
            if doctest_indent is not None:
                if line.strip() and line.startswith(doctest_indent):
                    out.append(line)
                    continue
                out.append(f"{doctest_indent}```")
                doctest_indent = None
            if FENCE.match(line):
                fenced = not fenced
            prompt = None if fenced else PROMPT.match(line)
            if prompt:
                doctest_indent = prompt.group(1)
                if out and out[-1].strip():
                    out.append("")
                out.extend((f"{doctest_indent}```pycon", line))
                continue
            out.append(line if fenced else ROLE.sub(r"`\1`", line))
        if doctest_indent is not None:
            out.append(f"{doctest_indent}```")
        return out


class DoctestExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:  # Markdown's name
        md.preprocessors.register(DoctestFences(md), "mha_doctests", 30)  # before fenced_code


def on_config(config: Any) -> Any:
    """Add the doctest fences to the extensions every page and docstring is rendered with."""
    config.markdown_extensions.append(DoctestExtension())
    return config
