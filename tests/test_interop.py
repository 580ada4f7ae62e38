"""Weights from PyTorch and GPT-2, back to PyTorch, and to and from .npz files."""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np
import pytest
from support.configs import relative_error

import mha
from mha import MultiHeadAttention, WeightsFileError
from mha.integrations import npz


def torch_module(torch, seed, *, dtype="float64", batch_first=True):
    """A randomly configured nn.MultiheadAttention with random (not default) parameters."""
    rng = np.random.default_rng(seed)
    H = int(rng.choice([1, 2, 4]))
    E = H * int(rng.integers(1, 6))
    kdim = E if rng.random() < 0.5 else int(rng.integers(1, 10))
    vdim = kdim if rng.random() < 0.5 else int(rng.integers(1, 10))
    module = torch.nn.MultiheadAttention(
        E, H, bias=bool(rng.random() < 0.7), add_bias_kv=bool(rng.random() < 0.3),
        add_zero_attn=bool(rng.random() < 0.3), kdim=kdim, vdim=vdim, batch_first=batch_first,
        dtype=getattr(torch, dtype),
    ).eval()  # fmt: skip
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_()
    return module, rng


def inputs(module, rng, dtype):
    N, L, S = int(rng.integers(1, 4)), int(rng.integers(1, 8)), int(rng.integers(1, 8))
    X = rng.standard_normal((N, L, module.embed_dim)).astype(dtype)
    K = rng.standard_normal((N, S, module.kdim)).astype(dtype)
    V = rng.standard_normal((N, S, module.vdim)).astype(dtype)
    lengths = rng.integers(1, S + 1, size=N)
    return X, K, V, lengths


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("seed", range(40))
def test_from_torch_module_matches_torch(seed, dtype, batch_first, torch, record_error):
    module, rng = torch_module(torch, seed, dtype=dtype, batch_first=batch_first)
    ours = MultiHeadAttention.from_torch(module)
    assert ours.dtype == np.dtype(dtype)
    X, K, V, lengths = inputs(module, rng, dtype)
    S, L = K.shape[1], X.shape[1]
    padding = torch.from_numpy(np.arange(S) >= lengths[:, None])  # torch: True = padding
    causal = torch.from_numpy(np.triu(np.ones((L, S), dtype=bool), k=1 + S - L))
    layout = (lambda a: a) if batch_first else (lambda a: a.transpose(1, 0, 2))
    with torch.no_grad():
        expected, expected_weights = module(
            *(torch.from_numpy(np.ascontiguousarray(layout(a))) for a in (X, K, V)),
            key_padding_mask=padding, attn_mask=causal, average_attn_weights=False,
        )  # fmt: skip
    out, weights = ours(X, key=K, value=V, key_lengths=lengths, causal=True, return_weights=True)
    expected = layout(expected.numpy())
    rows = np.isfinite(expected).all(axis=-1)  # torch: NaN where a row sees no key
    tolerance = 1e-12 if dtype == "float64" else 2e-5
    assert (
        record_error(
            f"from_torch vs nn.MultiheadAttention, {dtype}",
            relative_error(out[rows], expected[rows]),
        )
        <= tolerance
    )
    finite = np.isfinite(expected_weights.numpy())
    assert relative_error(weights[finite], expected_weights.numpy()[finite]) <= tolerance


@pytest.mark.parametrize("seed", range(20))
def test_state_dict_round_trips_are_exact(seed, torch):
    module, _ = torch_module(torch, seed)
    from_state = MultiHeadAttention.from_torch(
        module.state_dict(), num_heads=module.num_heads, add_zero_attn=module.add_zero_attn
    )
    from_module = MultiHeadAttention.from_torch(module)
    state = from_module.to_torch_state_dict()
    assert set(state) == set(module.state_dict())
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(state[name], value.numpy())
    fresh = torch.nn.MultiheadAttention(
        module.embed_dim, module.num_heads, bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None, kdim=module.kdim, vdim=module.vdim,
        dtype=torch.float64,
    )  # fmt: skip
    fresh.load_state_dict({name: torch.as_tensor(value) for name, value in state.items()})
    for name, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), module.state_dict()[name].numpy())
    for name in npz.WEIGHT_NAMES:
        a, b = getattr(from_state, name), getattr(from_module, name)
        assert (a is None and b is None) or np.array_equal(a, b)
    again = MultiHeadAttention.from_torch(state, num_heads=from_module.num_heads)
    np.testing.assert_array_equal(again.W_v, from_module.W_v)


def test_our_own_module_exports_to_torch(torch):
    ours = MultiHeadAttention(8, 2, kdim=5, bias=True, add_bias_kv=True, seed=0)
    module = torch.nn.MultiheadAttention(8, 2, kdim=5, bias=True, add_bias_kv=True,
                                         batch_first=True, dtype=torch.float64)  # fmt: skip
    module.load_state_dict({k: torch.as_tensor(v) for k, v in ours.to_torch_state_dict().items()})
    rng = np.random.default_rng(1)
    X, K, V = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 5)), np.ones((2, 4, 8))
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in (X, K, V)))[0]
    assert relative_error(ours(X, key=K, value=V), expected.numpy()) <= 1e-12


STATE = {
    "in_proj_weight": np.zeros((24, 8)), "in_proj_bias": np.zeros(24),
    "out_proj.weight": np.zeros((8, 8)), "out_proj.bias": np.zeros(8),
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"in_proj_weight": np.zeros((24, 7))},
         r"in_proj_weight has shape \(24, 7\); expected \(24, 8\)"),
        ({"out_proj.bias": np.zeros(9)}, r"out_proj.bias has shape \(9,\); expected \(8,\)"),
        ({"extra.weight": np.zeros(3)},
         r"keys that nn.MultiheadAttention does not: \['extra.weight'\]"),
        ({"in_proj_weight": None}, r"neither 'in_proj_weight' nor all of q/k/v_proj_weight"),
        ({"out_proj.bias": None}, r"only one of 'in_proj_bias' and 'out_proj.bias'"),
        ({"bias_k": np.zeros((1, 1, 8))}, r"only one of 'bias_k' and 'bias_v'"),
        ({"bias_k": np.zeros(8), "bias_v": np.zeros(8)},
         r"bias_k has shape \(8,\); expected \(1, 1, 8\)"),
        ({"q_proj_weight": np.zeros((8, 8))}, r"both 'in_proj_weight' and separate"),
        ({"out_proj.weight": None}, r"no 'out_proj.weight'"),
    ],
)  # fmt: skip
def test_state_dict_errors_name_the_key(change, message):
    state = {k: v for k, v in (STATE | change).items() if v is not None}
    with pytest.raises(mha.AttentionError, match=message):
        MultiHeadAttention.from_torch(state, num_heads=2)


def test_state_dict_needs_num_heads():
    with pytest.raises(mha.AttentionValueError, match=r"pass num_heads="):
        MultiHeadAttention.from_torch(STATE)
    with pytest.raises(mha.AttentionValueError, match=r"takes a torch\.nn\.MultiheadAttention"):
        MultiHeadAttention.from_torch([1, 2])


def gpt2_attention_in_torch(torch, x, c_attn_w, c_attn_b, c_proj_w, c_proj_b, H):
    """GPT-2's attention block written with torch operations (Conv1D is x @ W + b)."""
    x = torch.from_numpy(x)
    qkv = x @ torch.from_numpy(c_attn_w) + torch.from_numpy(c_attn_b)
    q, k, v = qkv.split(x.shape[-1], dim=-1)
    B, T, E = x.shape

    def heads(t):
        return t.view(B, T, H, E // H).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(E // H)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), -torch.inf)
    out = (torch.softmax(scores, dim=-1) @ heads(v)).transpose(1, 2).reshape(B, T, E)
    return (out @ torch.from_numpy(c_proj_w) + torch.from_numpy(c_proj_b)).numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("seed", range(5))
def test_gpt2_layout_matches_a_torch_gpt2_attention(seed, dtype, torch, record_error):
    rng = np.random.default_rng(seed)
    H, E, T = 4, 32, 9
    weights = tuple(a.astype(dtype) for a in (
        rng.standard_normal((E, 3 * E)) * 0.2, rng.standard_normal(3 * E) * 0.2,
        rng.standard_normal((E, E)) * 0.2, rng.standard_normal(E) * 0.2,
    ))  # fmt: skip
    x = rng.standard_normal((2, T, E)).astype(dtype)
    ours = MultiHeadAttention.from_gpt2(*weights, num_heads=H)
    assert ours.dtype == dtype
    expected = gpt2_attention_in_torch(
        torch, x.astype(np.float64), *(w.astype(np.float64) for w in weights), H
    )
    tolerance = 1e-12 if dtype == np.float64 else 2e-5
    error = relative_error(ours(x, mask=True), expected)
    assert record_error(f"GPT-2 layout vs torch, {np.dtype(dtype).name}", error) <= tolerance


def test_gpt2_shape_errors():
    with pytest.raises(mha.ShapeError, match=r"c_attn_weight must have shape \(E, 3E\)"):
        MultiHeadAttention.from_gpt2(
            np.zeros((4, 8)), np.zeros(12), np.zeros((4, 4)), np.zeros(4), 2
        )
    with pytest.raises(mha.ShapeError, match=r"c_proj_bias must have shape \(4,\)"):
        MultiHeadAttention.from_gpt2(
            np.zeros((4, 12)), np.zeros(12), np.zeros((4, 4)), np.zeros(5), 2
        )


MODULES = [
    lambda: MultiHeadAttention(8, 2, seed=0),
    lambda: MultiHeadAttention(12, 3, kdim=5, vdim=7, bias=True, dtype=np.float32, seed=1),
    lambda: MultiHeadAttention(8, 4, bias=True, add_bias_kv=True, add_zero_attn=True, seed=2),
]


@pytest.mark.parametrize("make", MODULES)
def test_save_and_load_round_trip_exactly(make, tmp_path):
    module = make()
    path = tmp_path / "attention.npz"
    module.save(path)
    loaded = MultiHeadAttention.load(path)
    assert repr(loaded) == repr(module)
    for name in npz.WEIGHT_NAMES:
        a, b = getattr(module, name), getattr(loaded, name)
        assert (a is None and b is None) or (np.array_equal(a, b) and a.dtype == b.dtype)
    X = np.random.default_rng(0).standard_normal((2, 3, 8 if module.d_model == 8 else 12))
    K = np.random.default_rng(1).standard_normal((2, 4, module.kdim))
    V = np.random.default_rng(2).standard_normal((2, 4, module.vdim))
    np.testing.assert_array_equal(
        loaded(X, key=K, value=V, causal=True), module(X, key=K, value=V, causal=True)
    )
    assert [p.name for p in tmp_path.iterdir()] == ["attention.npz"]  # no temporary left


def test_load_refuses_pickles_and_names_what_is_wrong(tmp_path):
    module = MultiHeadAttention(8, 2, seed=0)
    good = tmp_path / "good.npz"
    module.save(good)
    data = dict(np.load(good))

    def write(name, **entries):
        path = tmp_path / name
        np.savez(path, **entries)
        return path

    cases = {
        write("pickled.npz", **data | {"W_q": np.array([object()], dtype=object)}):
            r"pickled.npz is not an .npz file written by .*save\(\) "
            r"\(it holds Python objects, which mha never unpickles\)",
        write("noconfig.npz", **{k: v for k, v in data.items() if k != "config"}):
            r"noconfig.npz: it has no 'config' entry",
        write("badshape.npz", **data | {"W_o": np.zeros((8, 3))}):
            r"badshape.npz: W_o has shape \(8, 3\) but its config "
            r"\(d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, kdim=8, vdim=8\) "
            r"calls for \(8, 8\)$",
        write("extra.npz", **data | {"surprise": np.zeros(2)}):
            r"extra.npz: unexpected entries \['surprise'\]",
        write("format.npz", **data | {"config": np.array('{"format": "other", "version": 1}')}):
            r"format.npz: bad config entry \(format is 'other'",
        write("missing.npz", **{k: v for k, v in data.items() if k != "W_k"}):
            r"missing.npz: it lacks W_k, which its config .* calls for",
        tmp_path / "absent.npz": r"absent.npz: no such file",
        tmp_path: r"is a folder, not an .npz file",
    }  # fmt: skip
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    cases[single] = r"single.npy: it holds a single array, not an \.npz file"
    for path, message in cases.items():
        with pytest.raises(WeightsFileError, match=message):
            MultiHeadAttention.load(path)


def test_truncated_and_garbled_files_are_reported(tmp_path):
    path = tmp_path / "weights.npz"
    MultiHeadAttention(8, 2, seed=0).save(path)
    content = path.read_bytes()
    for cut in (10, len(content) // 2, len(content) - 5):
        path.write_bytes(content[:cut])
        damaged = r"weights.npz is not an .npz file written by .* \(it is damaged or truncated"
        with pytest.raises(WeightsFileError, match=damaged):
            MultiHeadAttention.load(path)
    path.write_bytes(os.urandom(300))
    garbage = r"is not an .npz file written by .* \(it is neither an .npz nor an .npy file\)"
    with pytest.raises(WeightsFileError, match=garbage):
        MultiHeadAttention.load(path)
    assert issubclass(WeightsFileError, OSError)


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_an_interrupted_save_leaves_the_old_file_intact(failure, tmp_path, monkeypatch):
    path = tmp_path / "weights.npz"
    MultiHeadAttention(8, 2, seed=0).save(path)
    before = path.read_bytes()

    def savez_that_fails(file, **arrays):
        with zipfile.ZipFile(file, "w") as archive:  # half of the file, then the failure
            archive.writestr("W_q.npy", b"\x93NUMPY partial")
        raise failure

    monkeypatch.setattr(npz.np, "savez", savez_that_fails)
    with pytest.raises(type(failure)):
        MultiHeadAttention(8, 2, seed=1).save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["weights.npz"]
    monkeypatch.undo()
    np.testing.assert_array_equal(
        MultiHeadAttention.load(path).W_q, MultiHeadAttention(8, 2, seed=0).W_q
    )


def test_saved_files_get_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        path = tmp_path / "weights.npz"
        MultiHeadAttention(8, 2, seed=0).save(path)
        assert path.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_save_errors_name_the_target(tmp_path):
    module = MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(WeightsFileError, match=r"cannot save to .*nodir/x.npz: there is no folder"):
        module.save(tmp_path / "nodir" / "x.npz")
    with pytest.raises(WeightsFileError, match=r"cannot save to .*: .* is a folder; give a file"):
        module.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_every_damaged_byte_is_caught_or_harmless(tmp_path):
    """Flip bits all through a saved file: loading either fails with WeightsFileError or
    gives back exactly the saved module (a flip in padding or an unused header field)."""
    module = MultiHeadAttention(8, 2, bias=True, add_bias_kv=True, seed=0)
    path = tmp_path / "weights.npz"
    module.save(path)
    content = bytearray(path.read_bytes())
    damaged = tmp_path / "damaged.npz"
    outcomes = {"refused": 0, "identical": 0}
    for offset in range(0, len(content), 3):
        for bit in (0x01, 0x80):
            copy = bytearray(content)
            copy[offset] ^= bit
            damaged.write_bytes(bytes(copy))
            try:
                loaded = MultiHeadAttention.load(damaged)
            except WeightsFileError:
                outcomes["refused"] += 1
                continue
            for name in npz.WEIGHT_NAMES:
                np.testing.assert_array_equal(getattr(loaded, name), getattr(module, name))
            assert repr(loaded) == repr(module)
            outcomes["identical"] += 1
    assert outcomes["refused"] > 0


def test_from_torch_reads_bfloat16_weights(torch):
    """As ml_dtypes.bfloat16, the same numbers (tests/test_bfloat16.py: the same bits, and
    exact float32 without ml_dtypes)."""
    module = torch.nn.MultiheadAttention(8, 2, dtype=torch.bfloat16)
    ours = MultiHeadAttention.from_torch(module)
    assert ours.dtype.name == "bfloat16"
    np.testing.assert_array_equal(
        ours.W_o.astype(np.float32), module.out_proj.weight.detach().float().numpy().T
    )
