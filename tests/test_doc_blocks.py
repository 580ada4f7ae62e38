"""Every code block of the README and of docs/*.md runs as pasted, or says why it is not run.

A block's language says what it is. ``python`` blocks run here, each in a fresh namespace
and an empty working folder; a block that names a checkpoint folder (CHECKPOINTS) runs with
that folder replaced by a tiny saved checkpoint of the same family
(tests/support/pretrained_models.py). ``bash`` blocks are commands: the README's are run by
CI (.ci/run), and the others are named in ELSEWHERE with the test that runs them or the
reason they are not run here. ``text`` blocks are formulas, diagrams and printed output.
A block with no language, or another one, fails here.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(.*?)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)

# The checkpoint folders the docs name, as written, and the family of the tiny checkpoint
# that stands in for each in the tests.
CHECKPOINTS = {
    '"Qwen3-0.6B"': "qwen3",
    '"DeepSeek-V2-Lite"': "deepseek_v2",
    '"Jamba-v0.1"': "jamba",
    '"gemma-3n-E2B"': "gemma3n",
}

# Blocks run elsewhere or not run, found by a line they hold: (page, line) -> why.
ELSEWHERE = {
    ("README.md", "pip install"): ".ci/run runs each of the README's commands in a fresh "
    "environment (tests/test_readme.py checks that it finds them all)",
    ("docs/dask.md", "result = out.compute()"): "tests/test_dask.py runs it and compares "
    "the result with the in-memory call",
    ("docs/dask.md", "dask scheduler --scheduler-file"): "tests/test_dask.py starts the "
    "scheduler and the workers as written",
    ("docs/dask.md", 'Client(scheduler_file="~/scheduler.json")'): "tests/test_dask.py runs "
    "it against the scheduler it started (the scheduler file's path changed)",
    ("docs/testing.md", "MHA_FUZZ_EXAMPLES=5000"): "5,000 examples per part take minutes; "
    "tests/test_fuzz.py runs the same fuzzer at its default size",
    ("docs/testing.md", "python scripts/fuzz.py --minutes 15"): "runs of 15 minutes and "
    "300,000 calls; their options are checked against the script below",
}


def blocks() -> list[tuple[str, int, str, str]]:
    """``(page, line, language, code)`` for every fenced block of every page."""
    found = []
    for path in PAGES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((str(path.relative_to(ROOT)), line, match.group(1), match.group(2)))
    return found


def elsewhere(page: str, code: str) -> str | None:
    reasons = [why for (where, held), why in ELSEWHERE.items() if where == page and held in code]
    return reasons[0] if reasons else None


BLOCKS = blocks()
PYTHON = [b for b in BLOCKS if b[2] == "python" and elsewhere(b[0], b[3]) is None]


def test_every_block_says_what_it_is():
    for page, line, language, code in BLOCKS:
        assert language in ("python", "bash", "text"), f"{page}:{line} has ```{language}"
        if language == "bash":
            assert elsewhere(page, code), f"{page}:{line}: a command no test or CI step runs"


def test_every_exception_is_still_there():
    """Each entry of ELSEWHERE and CHECKPOINTS matches a block: none is left over."""
    for page, held in ELSEWHERE:
        assert any(b[0] == page and held in b[3] for b in BLOCKS), (page, held)
    for folder in CHECKPOINTS:
        assert any(folder in b[3] for b in PYTHON), folder


@pytest.mark.parametrize(
    ("page", "code"), [pytest.param(b[0], b[3], id=f"{b[0]}:{b[1]}") for b in PYTHON]
)
def test_python_block_runs_as_pasted(page, code, tmp_path, monkeypatch, request):
    if "import torch" in code:
        request.getfixturevalue("torch")
    used = [folder for folder in CHECKPOINTS if folder in code]
    if used:
        request.getfixturevalue("transformers")
        from support import pretrained_models as models

        for folder in used:  # the fixture path, in place of the checkpoint the page names
            code = code.replace(folder, repr(str(models.saved(CHECKPOINTS[folder]))))
    monkeypatch.chdir(tmp_path)  # files a block writes land in an empty folder
    exec(compile(code, page, "exec"), {"__name__": "__doc_block__"})


def test_every_quoted_error_is_the_one_raised():
    """The errors the pages quote are the README's, which tests/test_readme.py raises."""
    quoted = {line for b in BLOCKS if b[2] == "text" for line in b[3].splitlines()
              if re.match(r"mha\.\w+Error: ", line)}  # fmt: skip
    assert quoted == {"mha.ShapeError: K has 6 positions but V has 5 (K (2, 6, 8), V (2, 5, 8))"}


def test_the_fuzz_commands_name_the_scripts_options():
    (block,) = [b[3] for b in BLOCKS if "python scripts/fuzz.py --minutes 15" in b[3]]
    usage = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz.py"), "--help"], capture_output=True,
        text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for option in re.findall(r"(--[a-z-]+)", block):
        assert option in usage, option


# --- what the examples show, beyond running -----------------------------------------------


def run_block(page: str, holding: str) -> dict:
    """Run the one Python block of ``page`` that holds ``holding``; return its namespace."""
    (code,) = [b[3] for b in PYTHON if b[0] == page and holding in b[3]]
    namespace: dict = {"__name__": "__doc_block__"}
    exec(compile(code, page, "exec"), namespace)
    return namespace


def test_the_guides_torch_example_round_trips(torch, tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    namespace = run_block("docs/guide.md", "from_torch(trained)")
    np.testing.assert_allclose(namespace["out2"].transpose(1, 0, 2), namespace["attention"](
        namespace["x"]), rtol=1e-5, atol=1e-6)  # fmt: skip
    assert namespace["weights"].shape == (2, 5, 5)


def test_the_guides_decoding_example_prints_what_it_says(capsys):
    namespace = run_block("docs/guide.md", "cache.truncate([7, 6])")
    assert capsys.readouterr().out.strip() == "[8 6]"
    cache = namespace["cache"]
    assert cache.lengths.tolist() == [6, 7] and namespace["out"].shape == (2, 1, 64)


def test_the_serving_example_shares_the_prompts_blocks(capsys):
    """Two forks of a shared prompt: the blocks held are the prompt's three, and one copy
    (the first fork to write into the shared, half-full third block)."""
    import numpy as np

    import mha

    namespace = run_block("docs/serving.md", "pool.fork(")
    assert capsys.readouterr().out.strip() == "[41 41] 1020"
    tables = namespace["pool"].block_table()
    assert (tables[0, :2] == tables[1, :2]).all() and tables[0, 2] != tables[1, 2]
    x = namespace["x"]
    alone = mha.scaled_dot_product_attention(x[None, :, :41], x[None, :2, :41], x[None, :2, :41],
                                             causal=True)[:, :, -1:]  # fmt: skip
    np.testing.assert_allclose(namespace["out"], np.repeat(alone, 2, 0), rtol=1e-6)


def test_the_sinks_example_gives_the_dense_formulas_gradient(capsys):
    """The example's sinks gradient is the dense formula's, and its document mask is the
    boolean mask it stands for."""
    import numpy as np

    import mha

    namespace = run_block("docs/variants.md", "sinks = np.zeros(8)")
    assert capsys.readouterr().out.strip() == "(8,) (1, 8, 256, 64)"
    q, k, v, doc = (namespace[name] for name in ("q", "k", "v", "doc"))
    i, j = np.arange(256)[:, None], np.arange(256)[None]
    dense = mha.scaled_dot_product_attention(q, k, v, mask=(doc[i] == doc[j]) & (i >= j))
    np.testing.assert_allclose(namespace["packed"], dense, rtol=1e-13, atol=1e-13)
    s = np.where((j <= i) & (i - j < 128), q @ k.swapaxes(-1, -2) / 8.0, -np.inf)
    lse = np.logaddexp(np.logaddexp.reduce(s, axis=-1), 0.0)  # the sinks are 0
    out = np.exp(s - lse[..., None]) @ v
    # d out / d sink = -exp(sink - lse) * out; grad_out is ones
    expected = -(np.exp(0.0 - lse) * out.sum(axis=-1)).sum(axis=(0, 2))
    np.testing.assert_allclose(namespace["grads"]["sinks"], expected, rtol=1e-11)


def test_the_readmes_checkpoint_example_decodes_a_token(transformers, capsys):
    from support import pretrained_models as models

    (code,) = [b[3] for b in PYTHON if b[0] == "README.md" and '"Qwen3-0.6B"' in b[3]]
    code = code.replace('"Qwen3-0.6B"', repr(str(models.saved("qwen3"))))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert capsys.readouterr().out.strip() == "[6]"
    assert namespace["step"].shape == (1, 1, namespace["attention"].d_model)


# --- the documentation site ---------------------------------------------------------------


def test_the_api_reference_has_every_public_name():
    """Each name ``mha`` exports has its entry in docs/api/mha.md (the exceptions by
    ``mha.errors``'s), and each public module its page."""
    import inspect

    import mha

    page = (ROOT / "docs" / "api" / "mha.md").read_text()
    for name in mha.__all__:
        obj = getattr(mha, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert "::: mha.errors" in page
        else:
            assert f"::: mha.{name}\n" in page, name
    for module in ("cache", "torch_compat", "flash_compat", "dask", "cli"):
        assert f"::: mha.{module}\n" in (ROOT / "docs" / "api" / f"{module}.md").read_text()


def test_the_site_builds_without_a_warning(tmp_path):
    """``mkdocs build --strict`` (the ``docs`` extra; CI's full tier installs it and sets
    MHA_REQUIRE_DOCS=1, making its absence a failure)."""
    for module in ("mkdocs", "mkdocstrings_handlers.python"):
        try:
            importlib.import_module(module)
        except ImportError:
            if os.environ.get("MHA_REQUIRE_DOCS") == "1":
                pytest.fail(f"MHA_REQUIRE_DOCS=1 but {module} cannot be imported: mha[docs]")
            pytest.skip(f"{module} is not installed (pip install mha[docs]): the site not built")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    assert "WARNING" not in built.stderr, built.stderr[-3000:]
