"""examples/train.py: its hand-written gradients and Adam, with mha's attention gradients,
train exactly as the same model does in torch, and the task is learnt."""

from __future__ import annotations

import math

import numpy as np
import train


def torch_losses(torch, model, batches, lr):
    """The same model, initialisation and batches, trained by torch.autograd and torch's
    Adam; its losses."""
    p = {name: torch.tensor(W.copy(), requires_grad=True) for name, W in model.params.items()}
    optimiser = torch.optim.Adam(p.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    H, n = model.attention.num_heads, model.n

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight

    losses = []
    for tokens, targets in batches:
        tokens_t = torch.from_numpy(tokens)
        x = p["embed"][tokens_t] + p["position"]
        a = rms(x, p["norm1"])
        B, L, d = a.shape

        def heads(W, b, a=a, B=B, L=L):
            return (a @ p[W] + p[b]).reshape(B, L, H, -1).transpose(1, 2)

        q, k, v = heads("W_q", "b_q"), heads("W_k", "b_k"), heads("W_v", "b_v")
        logits = q @ k.transpose(-1, -2) / math.sqrt(d // H)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        weights = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(B, L, d) @ p["W_o"] + p["b_o"]
        h = x + attended
        y = h + torch.relu(rms(h, p["norm2"]) @ p["W_up"] + p["b_up"]) @ p["W_down"] + p["b_down"]
        out = rms(y[:, n:], p["norm_out"]) @ p["W_out"]
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 torch.from_numpy(targets).reshape(-1))  # fmt: skip
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def test_the_first_20_losses_equal_torchs(torch, record_error):
    rng = np.random.default_rng(3)
    batches = [train.batch(rng, 32, 5) for _ in range(20)]
    model = train.Model(5, d=32, heads=4, hidden=48, seed=7)
    expected = torch_losses(torch, model, batches, lr=3e-3)
    adam = train.Adam(model.params, lr=3e-3)
    ours = []
    for tokens, targets in batches:
        loss, saved = model.loss(tokens, targets)
        adam.step(model.gradients(saved))
        ours.append(loss)
    assert expected[-1] < expected[0]  # it learns
    error = max(abs(a - b) / abs(b) for a, b in zip(ours, expected, strict=True))
    assert record_error("training losses vs torch (20 steps)", error) <= 1e-9


def test_reversal_is_learnt():
    result = train.train(n=4, steps=600, batch_size=32, target=0.99, report=lambda *a: None)
    assert result["accuracy"] >= 0.99 and result["steps"] <= 600


def test_the_readme_and_the_example_give_the_same_run_time():
    """One figure for how long the example takes, in both places that state it."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    paragraph = readme[readme.index("`examples/train.py` trains") :][:400]
    stated = {
        "README": re.findall(r"about (\d+) s on two cores", paragraph),
        "train.py": re.findall(r"about (\d+) s on two cores", train.__doc__),
    }
    assert stated["README"] == stated["train.py"] and len(stated["README"]) == 1, stated
