"""What a newcomer's trial found, one section per class of defect: nothing accepted without
effect, nothing accepted that cannot mean what was given, nothing impossible to satisfy,
messages that name what to fix, paths checked before any work, and docs that agree with the
code. (Reproducibility, the sixth class, is in test_reproducibility.py.)"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
from test_cli import mha_command, one_line_error

import mha
from mha import _files, torch_compat
from mha._kernel import contract
from mha.cli import _common, bench
from mha.cli import plots as plotting

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
r = np.random.default_rng(8)


def write_inputs(path, *, unbatched=False, **extra):
    lead = () if unbatched else (2,)
    data = {
        "Q": r.standard_normal((*lead, 3, 8)), "K": r.standard_normal((*lead, 5, 6)),
        "V": r.standard_normal((*lead, 5, 6)), "W_q": r.standard_normal((8, 8)),
        "W_k": r.standard_normal((6, 8)), "W_v": r.standard_normal((6, 8)),
        "W_o": r.standard_normal((8, 4)),
    }  # fmt: skip
    data.update(extra)
    np.savez(path, **data)
    return data


# ------------------------------------------------------------- 1. accepted but without effect


def test_run_refuses_npz_entries_it_would_ignore(tmp_path):
    data = write_inputs(tmp_path / "in.npz", bias_q=np.ones(8))
    result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, cwd=tmp_path)
    one_line_error(result, "in.npz has an entry 'bias_q'", "does not use", "did you mean 'b_q'?")
    assert not (tmp_path / "o.npy").exists()
    mha.MultiHeadAttention(8, 2, seed=0).save(tmp_path / "m.npz")
    np.savez(tmp_path / "x.npz", X=data["Q"], Q=data["Q"])
    one_line_error(mha_command("run", "x.npz", "--module", "m.npz", "-o", "o.npy", cwd=tmp_path),
                   "entry 'Q' that mha run with --module does not use (it reads X)")  # fmt: skip


def test_top_left_without_a_causal_mask_is_refused(tmp_path):
    write_inputs(tmp_path / "in.npz")
    result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, "--top-left", cwd=tmp_path)
    one_line_error(result, "--top-left aligns the causal mask: use it with --causal")
    Q, K, V = r.standard_normal((3, 2, 3, 8))
    W = r.standard_normal((4, 8, 8))
    q = r.standard_normal((2, 2, 3, 4))
    calls = [
        lambda align: mha.multi_head_attention(Q, K, V, *W, 2, causal_alignment=align),
        lambda align: mha.scaled_dot_product_attention(q, q, q, causal_alignment=align),
        lambda align: mha.MultiHeadAttention(8, 2)(Q, causal_alignment=align),
        lambda align: mha.MultiHeadAttention(8, 2)(Q, False, causal_alignment=align),
    ]
    for call in calls:
        for alignment in ("top_left", "bottom_right"):
            with pytest.raises(mha.AttentionValueError, match="has no effect without a causal"):
                call(alignment)
    top_left = mha.multi_head_attention(Q, K[:, :2], V[:, :2], *W, 2, causal=True,
                                        causal_alignment="top_left")  # fmt: skip
    assert not np.array_equal(top_left, mha.multi_head_attention(Q, K[:, :2], V[:, :2], *W, 2,
                                                                 causal=True))  # fmt: skip


@pytest.mark.parametrize(
    "option", [["--heads", "2"], ["--causal"], ["--top-left"], ["--key-lengths", "1,1"],
               ["--query-lengths", "1,1"], ["--module", "m.npz"], ["--window", "2"]],
)  # fmt: skip
def test_plot_of_saved_weights_refuses_options_only_input_uses(tmp_path, option):
    np.save(tmp_path / "w.npy", np.full((2, 2, 3, 5), 0.2))
    result = mha_command("plot", "--weights", "w.npy", *option, "-o", "p.png", cwd=tmp_path)
    one_line_error(result, f"{option[0]} is used only with --input")
    assert not (tmp_path / "p.png").exists()


# -------------------------------------------------------------- 2. accepted but wrong


def test_plot_refuses_arrays_that_cannot_be_weights(tmp_path):
    write_inputs(tmp_path / "in.npz")
    assert mha_command("run", "in.npz", "-o", "out.npy", "--heads", 2, cwd=tmp_path).returncode == 0
    result = mha_command("plot", "--weights", "out.npy", "-o", "p.png", cwd=tmp_path)
    one_line_error(result, "--weights out.npy cannot be attention weights", "lie in [0, 1])")
    np.save(tmp_path / "rows.npy", np.full((2, 3, 4), 0.5))  # in [0, 1], rows sum to 2
    one_line_error(mha_command("plot", "--weights", "rows.npy", "-o", "p.png", cwd=tmp_path),
                   "row (0, 0) sums to 2, not 1 or 0")  # fmt: skip
    np.save(tmp_path / "nan.npy", np.full((3, 3), np.nan))
    one_line_error(mha_command("plot", "--weights", "nan.npy", "-o", "p.png", cwd=tmp_path),
                   "NaN or inf")  # fmt: skip
    assert not (tmp_path / "p.png").exists()
    with pytest.raises(mha.AttentionValueError, match="cannot be attention weights"):
        plotting.plot_attention(-np.ones((3, 3)), tmp_path / "p.png")
    plotting.check_weights(np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None])  # causal: fine
    plotting.check_weights(np.zeros((2, 3)))  # rows that see no key


def test_the_second_positional_argument_of_forward_is_always_the_mask():
    attention = mha.MultiHeadAttention(8, 2, seed=0)
    X, memory = r.standard_normal((2, 4, 8)), r.standard_normal((2, 6, 8))
    zero_one = np.tril(np.ones((4, 4)))  # a float 0/1 mask: was silently taken as the key
    for second in (memory, zero_one, zero_one.tolist(), 1, 0.0):
        with pytest.raises(mha.AttentionTypeError) as caught:
            attention(X, second)
        assert "key= (and value=) by name" in str(caught.value)
        assert "True = may attend" in str(caught.value) and "bias=" in str(caught.value)
    with pytest.raises(mha.AttentionTypeError, match="at most two positional arguments"):
        attention(X, None, memory)
    with pytest.raises(mha.AttentionValueError, match="value= without key="):
        attention(X, value=memory)
    boolean = zero_one.astype(bool)
    np.testing.assert_array_equal(attention(X, boolean), attention(X, mask=boolean))
    np.testing.assert_array_equal(attention(X, boolean.tolist()), attention(X, mask=boolean))
    cross = attention(X, key=memory)
    W = (attention.W_q, attention.W_k, attention.W_v, attention.W_o)
    np.testing.assert_array_equal(cross, mha.multi_head_attention(X, memory, memory, *W, 2))


def test_plot_from_input_hatches_masked_cells_not_underflowed_ones(tmp_path):
    x = np.array([[30.0, 0.0], [-30.0, 0.0], [0.0, 30.0]])  # far apart: some weights underflow
    eye = np.eye(2)
    np.savez(tmp_path / "in.npz", Q=x, K=x, V=x, W_q=eye, W_k=eye, W_v=eye, W_o=eye)
    _, weights = mha.multi_head_attention(x, x, x, eye, eye, eye, eye, 1, return_weights=True)
    assert (weights == 0).any()  # a visible key whose weight underflowed to exactly 0
    plain = mha_command("plot", "--input", "in.npz", "--heads", 1, "-o", "plain.svg", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "<pattern" not in (tmp_path / "plain.svg").read_text()  # nothing is masked
    causal = mha_command("plot", "--input", "in.npz", "--heads", 1, "--causal", "-o", "c.svg",
                         cwd=tmp_path)  # fmt: skip
    assert causal.returncode == 0, causal.stderr
    assert "<pattern" in (tmp_path / "c.svg").read_text() and "hatched: masked" in (
        tmp_path / "c.svg").read_text()  # fmt: skip


# ------------------------------------------------------- 3. impossible to satisfy


def test_lengths_work_with_unbatched_inputs(tmp_path):
    data = write_inputs(tmp_path / "in.npz", unbatched=True)
    result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, "--key-lengths", 3,
                         "--query-lengths", 2, "--weights", "w.npy", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = mha.multi_head_attention(*(data[k] for k in _common.DATA_KEYS), 2, key_lengths=3,
                                        query_lengths=2)  # fmt: skip
    # --weights asks for the weights: the Python walk, which rounds apart from the compiled one
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), expected, rtol=1e-14, atol=1e-14)
    plot = mha_command("plot", "--input", "in.npz", "--heads", 2, "--key-lengths", 3, "-o",
                       "p.png", cwd=tmp_path)  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    one_line_error(mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, "--key-lengths",
                               "3,2", cwd=tmp_path),
                   "--key-lengths gives 2 lengths but the inputs are one unbatched sequence",
                   "give one length")  # fmt: skip
    write_inputs(tmp_path / "batched.npz")
    one_line_error(mha_command("run", "batched.npz", "-o", "o.npy", "--heads", 2,
                               "--query-lengths", "3", cwd=tmp_path),
                   "--query-lengths gives 1 length but the inputs hold 2 sequences")  # fmt: skip


# ------------------------------------------------- 4. messages a user can act on


def test_cli_messages_name_the_options_typed(tmp_path):
    write_inputs(tmp_path / "in.npz")
    cases = [
        (("demo", "--seed", "-1"), "argument --seed: expected a whole number >= 0, got '-1'"),
        (("check", "--seed", "x"), "argument --seed: expected a whole number >= 0"),
        (("run", "in.npz", "-o", "o.npy", "--heads", "0"), "argument --heads: expected a whole"),
        (("run", "in.npz", "-o", "o.npy", "--heads", "3"), "--heads 3 does not divide the 8"),
        (
            ("run", "in.npz", "-o", "o.npy", "--heads", "2", "--key-lengths", "9,1"),
            "--key-lengths must be <= 5",
        ),
        (
            ("run", "in.npz", "-o", "o.npy", "--heads", "2", "--query-lengths=-1,1"),
            "--query-lengths must be >= 0",
        ),
        (
            ("plot", "--input", "in.npz", "--heads", "2", "--tokens", "a b", "-o", "p.png"),
            "--tokens has 2 tokens but the weights have 3 positions",
        ),
        (
            ("plot", "--input", "in.npz", "--heads", "2", "--key-tokens", "a", "-o", "p.png"),
            "--key-tokens has 1 tokens but the weights have 5 positions",
        ),
        (
            ("plot", "--input", "in.npz", "--heads", "2", "--batch", "-1", "-o", "p.png"),
            "argument --batch: expected a whole number >= 0",
        ),
    ]
    for args, message in cases:
        result = mha_command(*args, cwd=tmp_path)
        one_line_error(result, message)
        assert not re.search(r"\b(num_heads|key_lengths|query_lengths|query_tokens)\b",
                             result.stderr)  # fmt: skip


def test_messages_never_show_a_temporary_file(tmp_path):
    write_inputs(tmp_path / "in.npz")
    for option in ("-o", "--weights"):
        outputs = ["-o", "o.npy", "--weights", "w.npy"]
        outputs[outputs.index(option) + 1] = "/proc/x.npy"
        result = mha_command("run", "in.npz", "--heads", 2, *outputs, cwd=tmp_path)
        shown = "--output" if option == "-o" else option
        one_line_error(result, f"cannot write {shown} /proc/x.npy")
        assert ".tmp" not in result.stderr
    with pytest.raises(OSError) as caught:
        _files.atomic_write("/proc/x.npy", lambda handle: handle.write(b"x"))
    assert caught.value.filename == "/proc/x.npy" and ".tmp" not in str(caught.value)
    with pytest.raises(OSError) as caught:
        _files.atomic_write(tmp_path / "a" / "b.npy", lambda handle: handle.write(b"x"))
    assert caught.value.filename == str(tmp_path / "a" / "b.npy")


def test_garbage_files_are_never_called_pickles(tmp_path):
    for name, content in (("junk.npz", b"not a zip file at all"), ("empty.npz", b"")):
        (tmp_path / name).write_bytes(content)
        result = mha_command("run", name, "-o", "o.npy", "--heads", 2, cwd=tmp_path)
        one_line_error(result, f"{name} is not an .npz file of named arrays")
        assert "pickle" not in result.stderr
        with pytest.raises(mha.WeightsFileError) as caught:
            mha.MultiHeadAttention.load(tmp_path / name)
        assert "pickle" not in str(caught.value)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    one_line_error(mha_command("plot", "--weights", "objects.npy", "-o", "p.png", cwd=tmp_path),
                   "holds Python objects, which mha never unpickles")  # fmt: skip


@pytest.mark.parametrize(
    "command", [["demo"], ["bench", "--smoke"], ["plot", "--weights", "w.npy"]]
)
def test_a_missing_extra_names_the_install_command(tmp_path, command):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    for module in ("rich", "matplotlib"):
        (blocker / f"{module}.py").write_text(f"raise ImportError('no {module} here')\n")
    np.save(tmp_path / "w.npy", np.full((3, 3), 1 / 3))
    output = ["--output", "out"] if command[0] == "bench" else ["-o", "out.png"]
    path = os.pathsep.join([str(blocker), *sys.path])  # the blockers first
    result = mha_command(*command, *output, cwd=tmp_path, env={"PYTHONPATH": path})
    one_line_error(result, "is not installed", 'pip install ".[cli]" in the mha checkout')
    assert "No module named" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_weights_and_output_the_same_path_says_so(tmp_path):
    write_inputs(tmp_path / "in.npz")
    result = mha_command("run", "in.npz", "-o", "o.npy", "--weights", "o.npy", "--heads", 2,
                         cwd=tmp_path)  # fmt: skip
    one_line_error(result, "--weights o.npy is the same file as --output")


def test_a_damaged_save_is_reported_against_its_config_and_names_the_path_once(tmp_path):
    path = tmp_path / "saved.npz"
    mha.MultiHeadAttention(8, 2, seed=0).save(path)
    data = dict(np.load(path))
    np.savez(path, **data | {"W_q": np.zeros((8, 6))})
    with pytest.raises(mha.WeightsFileError) as caught:
        mha.MultiHeadAttention.load(path)
    message = str(caught.value)
    assert message.count(str(path)) == 1, message
    assert (
        "W_q has shape (8, 6) but its config (d_model=8, num_heads=2, num_kv_heads=2, "
        "head_dim=4, kdim=8, vdim=8) calls for (8, 8)"
    ) in message


@pytest.mark.parametrize("zero", ["d_q", "d_kin", "d_vin", "d_v", "d_out"])
def test_zero_width_inputs_compute_instead_of_crashing(zero):
    widths = {"d_q": 3, "d_kin": 4, "d_vin": 5, "d_k": 2, "d_v": 2, "d_out": 3}
    widths[zero] = 0
    H, w = 2, widths
    Q, K, V = (r.standard_normal((2, n, w[d])) for n, d in ((3, "d_q"), (4, "d_kin"), (4, "d_vin")))
    W_q, W_k = r.standard_normal((w["d_q"], H * w["d_k"])), r.standard_normal((w["d_kin"], H * 2))
    W_v, W_o = r.standard_normal((w["d_vin"], H * w["d_v"])), r.standard_normal((H * w["d_v"], 3))
    W_o = W_o[:, : w["d_out"]]
    for workers in (1, 2):
        out = mha.multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, H, workers=workers)
        q, k, v = (np.moveaxis((X @ W).reshape(2, X.shape[1], H, W.shape[1] // H), 2, 1)
                   for X, W in ((Q, W_q), (K, W_k), (V, W_v)))  # fmt: skip
        scores = q @ k.swapaxes(-1, -2) / np.sqrt(2)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        joined = np.moveaxis(weights @ v, 1, 2).reshape(2, 3, -1)
        np.testing.assert_allclose(out, joined @ W_o, rtol=1e-12, atol=1e-14)


def test_zero_width_heads_on_the_command_line_do_not_suggest_scale(tmp_path):
    write_inputs(tmp_path / "in.npz", W_q=np.zeros((8, 0)), W_k=np.zeros((6, 0)))
    result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, cwd=tmp_path)
    one_line_error(result, "W_q in in.npz has no columns (W_q (8, 0))")
    assert "scale=" not in result.stderr


# --------------------------------------------------- 5. checked before any work


def test_unwritable_outputs_are_refused_before_any_work(tmp_path):
    write_inputs(tmp_path / "in.npz")
    result = mha_command("run", "in.npz", "-o", "o.npy", "--weights", "/proc/w.npy", "--heads", 2,
                         cwd=tmp_path)  # fmt: skip
    one_line_error(result, "cannot write --weights /proc/w.npy", "/proc is not writable")
    assert not (tmp_path / "o.npy").exists()  # the output was not written first
    for folder in ("/proc/results", "/proc/a/b"):
        bench_run = mha_command("bench", "--smoke", "--output", folder, cwd=tmp_path)
        one_line_error(bench_run, f"cannot write --output {folder}", "is not writable")
        assert bench_run.stdout == ""  # nothing measured
    one_line_error(mha_command("bench", "--smoke", "--readme", "README.md", cwd=tmp_path),
                   "--readme takes a full run's results only; drop --smoke")  # fmt: skip
    one_line_error(mha_command("plot", "--input", "in.npz", "--heads", 2, "-o", "/proc/p.png",
                               cwd=tmp_path), "cannot write --output /proc/p.png")  # fmt: skip
    with pytest.raises(mha.WeightsFileError, match=r"cannot save to /proc/m\.npz: /proc is not"):
        mha.MultiHeadAttention(8, 2).save("/proc/m.npz")


# ------------------------------------------------- docs and first contact


def public_callables():
    for name in mha.__all__:
        obj = getattr(mha, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            continue
        yield name, obj
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and callable(getattr(value, "__func__", value)):
                    yield f"{name}.{member}", getattr(value, "__func__", value)
    yield "torch_compat.multi_head_attention_forward", torch_compat.multi_head_attention_forward
    yield "plotting.plot_attention", plotting.plot_attention
    yield "plotting.check_weights", plotting.check_weights


@pytest.mark.parametrize(
    ("name", "obj"), [pytest.param(*pair, id=pair[0]) for pair in public_callables()]
)
def test_every_public_function_documents_every_argument(name, obj):
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj):
        doc += inspect.getdoc(obj.__init__) or ""
        obj = obj.__init__
    for parameter in inspect.signature(obj).parameters:
        if parameter in ("self", "cls", "misplaced"):
            continue
        assert re.search(rf"`{re.escape(parameter)}\b", doc), f"{name}: {parameter}"


def test_multi_head_attention_help_states_the_mask_polarity():
    doc = inspect.getdoc(mha.multi_head_attention)
    assert "True = may attend" in doc and "b_o" in doc.split("query_lengths", 1)[1][:200]


def test_query_padding_is_documented_as_the_code_behaves():
    Q = r.standard_normal((1, 3, 8))
    W = r.standard_normal((4, 8, 8))
    b_o = r.standard_normal(8)
    out = mha.multi_head_attention(Q, Q, Q, *W, 2, query_lengths=[1], b_o=b_o)
    np.testing.assert_array_equal(out[0, 1:], np.broadcast_to(b_o, (2, 8)))
    comparison = (ROOT / "docs" / "contract.md").read_text()
    for text in (
        README,
        (ROOT / "docs" / "algorithm.md").read_text(),
        contract.__doc__,
        comparison,
    ):
        for line in text.splitlines():
            if "query_lengths" in line or "query padding" in line.lower():
                assert "zero output" not in line, line
    row = next(line for line in comparison.splitlines() if line.startswith("| query padding"))
    assert "`b_o`" in row and "`b_o`" in README.split("## The mask contract")[1][:900]


def test_install_hints_work_from_a_checkout():
    sources = [README, *(p.read_text() for p in (ROOT / "src" / "mha").glob("*.py"))]
    assert not any('"mha[' in text or "'mha[" in text for text in sources)
    assert "--index-url https://download.pytorch.org/whl/cpu" in _common.TORCH_CPU
    assert _common.TORCH_CPU in README


def test_the_readme_has_a_fast_test_tier_and_the_full_oracle_command():
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL))
    assert 'pip install -e ".[test]" && pytest' in shell  # golden fixtures, no torch download
    assert "download.pytorch.org/whl/cpu" in shell and "torch==2.13.0" in shell


def test_the_specification_is_defined_where_it_is_named():
    assert "specification" in README.split("## ", 1)[0]  # defined in the opening lines
    for args in (["--help"], ["demo", "--help"]):
        help_text = subprocess.run([sys.executable, "-m", "mha", *args], capture_output=True,
                                   text=True, check=True).stdout  # fmt: skip
        assert "specification" not in help_text


def test_version_and_public_exception_names(tmp_path):
    result = mha_command("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"mha {mha.__version__}"
    try:
        mha.multi_head_attention(np.zeros((1, 2, 4)), np.zeros((1, 3, 4)), np.zeros((1, 2, 4)),
                                 *np.zeros((4, 4, 4)), 2)  # fmt: skip
    except mha.ShapeError as error:
        shown = traceback.format_exception_only(type(error), error)[-1]
    assert shown.startswith("mha.ShapeError: K has 3 positions but V has 2")
    for name in ("AttentionError", "AttentionTypeError", "AttentionValueError", "ShapeError",
                 "WeightsFileError"):  # fmt: skip
        assert repr(getattr(mha, name)) == f"<class 'mha.{name}'>"


def test_the_bias_default_is_stated_and_torch_export_is_one_line(torch):
    doc = inspect.getdoc(mha.MultiHeadAttention)
    assert "bias defaults to False" in doc and "defaults to ``bias=True``" in doc
    for bias in (False, True):
        ours = mha.MultiHeadAttention(8, 2, bias=bias, seed=1)
        if bias:
            ours.b_q, ours.b_o = r.standard_normal(8), r.standard_normal(8)
        module = torch.nn.MultiheadAttention(8, 2, bias=bias, batch_first=True, dtype=torch.float64)
        module.load_state_dict(ours.to_torch_state_dict(tensors=True))  # the one line
        built = ours.to_torch()
        X = r.standard_normal((2, 4, 8))
        for theirs in (module, built):
            expected = theirs(*(torch.from_numpy(X),) * 3, need_weights=False)[0].detach().numpy()
            np.testing.assert_allclose(ours(X), expected, rtol=1e-12, atol=1e-14)
        assert built.in_proj_weight.dtype == torch.float64 and not built.training


def test_the_demo_image_is_ignored_by_git():
    result = subprocess.run(["git", "check-ignore", "-q", "attention_demo.png"], cwd=ROOT)
    assert result.returncode == 0


def test_the_speed_table_says_which_cpu_and_kernel():
    import json

    results = json.loads((ROOT / "benchmarks" / "results" / "benchmark.json").read_text())
    results["environment"] |= {"processor": "Some CPU", "torch_cpu_capability": "AVX512",
                               "OPENBLAS_CORETYPE": "Haswell"}  # fmt: skip
    results["environment"]["blas"][0]["architecture"] = "Haswell"
    first = bench.markdown(results).splitlines()[0]
    assert "Some CPU" in first and "Haswell kernel" in first and "AVX512" in first
    assert "OPENBLAS_CORETYPE=Haswell" in first
    section = README.split("<!-- benchmark: begin -->", 1)[1]
    assert "kernel" in section.splitlines()[1]
    assert "another CPU" in README


def test_torch_compat_refuses_projection_weights_torch_would_ignore():
    x = r.standard_normal((3, 1, 4))
    common = dict(embed_dim_to_check=4, num_heads=2, in_proj_bias=None, bias_k=None,
                  bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=np.eye(4),
                  out_proj_bias=None)  # fmt: skip
    with pytest.raises(mha.AttentionValueError, match="q_proj_weight given with use_separate"):
        torch_compat.multi_head_attention_forward(
            x, x, x, in_proj_weight=np.eye(12, 4), q_proj_weight=np.eye(4), **common
        )
    with pytest.raises(mha.AttentionValueError, match="in_proj_weight given with use_separate"):
        torch_compat.multi_head_attention_forward(
            x, x, x, in_proj_weight=np.eye(12, 4), use_separate_proj_weight=True,
            q_proj_weight=np.eye(4), k_proj_weight=np.eye(4), v_proj_weight=np.eye(4), **common,
        )  # fmt: skip


def test_a_boolean_array_for_mha_run_points_to_its_options_not_a_keyword(tmp_path):
    """The library's message for a boolean Q points to mask=, which mha run does not have:
    the command says which entry holds booleans and which options set masks."""
    X = np.ones((2, 3, 8), dtype=bool)
    for name, extra in (("Q", {"Q": X}), ("b_o", {"b_o": np.ones(4, dtype=bool)})):
        write_inputs(tmp_path / "in.npz", **extra)
        result = mha_command("run", "in.npz", "-o", "o.npy", "--heads", 2, cwd=tmp_path)
        one_line_error(result, f"{name} in in.npz holds booleans", "--causal, --window")
        assert "mask=" not in result.stderr
    assert not (tmp_path / "o.npy").exists()
