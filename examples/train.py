"""Train a one-block Transformer in NumPy to reverse digit sequences, with mha's attention.

    python examples/train.py                 # about 5 s on two cores, then a PNG

The model reads ``x1 .. xn SEP`` and writes ``xn .. x1``, one token at a time (causal
self-attention). Token and position embeddings, layer norms, the MLP, the output head and
Adam are a few lines of NumPy each, with their gradients written out; attention and its
gradients come from ``mha.MultiHeadAttention(..., return_backward=True)``. It stops once
held-out sequences come out right token for token 99% of the time, and writes the loss curve
to ``train_loss.png`` (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import mha

DIGITS, SEP = 10, 10  # tokens 0-9 are digits, 10 separates input from output


def batch(rng: np.random.Generator, size: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``(size, 2n)``: the digits, SEP, the reversed digits but the last; and the
    targets ``(size, n)`` the model must predict at positions ``n .. 2n - 1``."""
    digits = rng.integers(0, DIGITS, (size, n))
    reverse = digits[:, ::-1].copy()
    tokens = np.concatenate([digits, np.full((size, 1), SEP), reverse[:, :-1]], axis=1)
    return tokens, reverse


class Model:
    """Embedding, pre-norm attention block, pre-norm MLP block, final norm, output head."""

    def __init__(self, n: int, d: int = 64, heads: int = 4, hidden: int = 128, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.attention = mha.MultiHeadAttention(d, heads, bias=True, seed=rng)
        self.n = n
        self.params: dict[str, np.ndarray] = {
            "embed": rng.normal(0, 0.5, (DIGITS + 1, d)),
            "position": rng.normal(0, 0.5, (2 * n, d)),
            "norm1": np.ones(d), "norm2": np.ones(d), "norm_out": np.ones(d),
            "W_up": rng.normal(0, 1 / np.sqrt(d), (d, hidden)), "b_up": np.zeros(hidden),
            "W_down": rng.normal(0, 1 / np.sqrt(hidden), (hidden, d)), "b_down": np.zeros(d),
            "W_out": rng.normal(0, 1 / np.sqrt(d), (d, DIGITS)),
        }  # fmt: skip
        self.params.update(self.attention.parameters())  # W_q .. b_o, updated in place

    def loss(self, tokens: np.ndarray, targets: np.ndarray) -> tuple[float, Any]:
        """Mean cross-entropy of the targets, and what :meth:`gradients` needs."""
        p = self.params
        x = p["embed"][tokens] + p["position"]
        a, norm1 = _rms_norm(x, p["norm1"])
        attended, attention_backward = self.attention(a, mask=True, return_backward=True)
        h = x + attended
        b, norm2 = _rms_norm(h, p["norm2"])
        up = b @ p["W_up"] + p["b_up"]
        act = np.maximum(up, 0.0)
        y = h + act @ p["W_down"] + p["b_down"]
        z, norm_out = _rms_norm(y[:, self.n :], p["norm_out"])
        logits = z @ p["W_out"]
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        saved = (tokens, targets, norm1, attention_backward, b, norm2, up, act, z, norm_out, probs)
        return float(-np.log(picked).mean()), saved

    def gradients(self, saved: Any) -> dict[str, np.ndarray]:
        """The loss's gradient for every parameter (backpropagation written out)."""
        p = self.params
        tokens, targets, norm1, attention_backward, b, norm2, up, act, z, norm_out, probs = saved
        g: dict[str, np.ndarray] = {}
        d_logits = probs.copy()  # softmax cross-entropy: probabilities minus one-hot targets
        picked = np.take_along_axis(probs, targets[..., None], axis=-1)
        np.put_along_axis(d_logits, targets[..., None], picked - 1.0, axis=-1)
        d_logits /= targets.size
        g["W_out"] = _outer(z, d_logits)
        d_y = np.zeros((*tokens.shape, p["norm1"].size))
        d_y[:, self.n :], g["norm_out"] = _rms_norm_backward(d_logits @ p["W_out"].T, norm_out)
        g["W_down"], g["b_down"] = _outer(act, d_y), d_y.sum(axis=(0, 1))
        d_up = (d_y @ p["W_down"].T) * (up > 0)
        g["W_up"], g["b_up"] = _outer(b, d_up), d_up.sum(axis=(0, 1))
        d_b, g["norm2"] = _rms_norm_backward(d_up @ p["W_up"].T, norm2)
        d_h = d_y + d_b
        attention = attention_backward(d_h)
        for name in self.attention.parameters():
            g[name] = attention[name]
        d_a = attention["query"] + attention["key"] + attention["value"]  # self-attention
        d_x_norm, g["norm1"] = _rms_norm_backward(d_a, norm1)
        d_x = d_h + d_x_norm
        g["position"] = d_x.sum(axis=0)
        g["embed"] = np.zeros_like(p["embed"])
        np.add.at(g["embed"], tokens, d_x)
        return g

    def predict(self, tokens: np.ndarray) -> np.ndarray:
        """Greedy answers ``(B, n)`` written one token at a time."""
        tokens = tokens.copy()
        for t in range(self.n):
            p = self.params
            x = p["embed"][tokens] + p["position"]
            h = x + self.attention(_rms_norm(x, p["norm1"])[0], mask=True)
            b = _rms_norm(h, p["norm2"])[0]
            y = h + np.maximum(b @ p["W_up"] + p["b_up"], 0.0) @ p["W_down"] + p["b_down"]
            logits = _rms_norm(y[:, self.n + t], p["norm_out"])[0] @ p["W_out"]
            if t + 1 < self.n:
                tokens[:, self.n + t + 1] = logits.argmax(axis=-1)
            else:
                last = logits.argmax(axis=-1)
        return np.concatenate([tokens[:, self.n + 1 :], last[:, None]], axis=1)


class Adam:
    """Adam (Kingma and Ba, 2015), updating the arrays in place."""

    def __init__(self, params: dict[str, np.ndarray], lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:  # fmt: skip
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = {name: np.zeros_like(W) for name, W in params.items()}
        self.v = {name: np.zeros_like(W) for name, W in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        b1, b2 = self.betas
        for name, W in self.params.items():
            self.m[name] = b1 * self.m[name] + (1 - b1) * grads[name]
            self.v[name] = b2 * self.v[name] + (1 - b2) * grads[name] ** 2
            m_hat = self.m[name] / (1 - b1**self.t)
            v_hat = self.v[name] / (1 - b2**self.t)
            W -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, Any]:
    inverse = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inverse
    return normed * weight, (normed, inverse, weight)


def _rms_norm_backward(grad: np.ndarray, saved: Any) -> tuple[np.ndarray, np.ndarray]:
    normed, inverse, weight = saved
    d_normed = grad * weight
    d_x = inverse * (d_normed - normed * np.mean(d_normed * normed, axis=-1, keepdims=True))
    return d_x, (grad * normed).reshape(-1, weight.size).sum(axis=0)


def _outer(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """``d(x @ W)/dW`` summed over every row."""
    return x.reshape(-1, x.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])


def train(n: int = 6, steps: int = 4000, batch_size: int = 64, target: float = 0.99,
          seed: int = 0, report: Any = print) -> dict[str, Any]:  # fmt: skip
    """Train until held-out accuracy reaches ``target`` (checked every 100 steps)."""
    rng = np.random.default_rng(seed)
    model = Model(n, seed=seed)
    adam = Adam(model.params)
    held_out = batch(np.random.default_rng(seed + 1), 1000, n)
    losses, accuracy, start = [], 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        loss, saved = model.loss(*batch(rng, batch_size, n))
        adam.step(model.gradients(saved))
        losses.append(loss)
        if step % 100 == 0:
            accuracy = float(np.mean(model.predict(held_out[0]) == held_out[1]))
            report(step, steps, loss, accuracy, time.perf_counter() - start)
            if accuracy >= target:
                break
    return {"losses": losses, "accuracy": accuracy, "seconds": time.perf_counter() - start,
            "steps": len(losses), "model": model}  # fmt: skip


def _progress(step: int, steps: int, loss: float, accuracy: float, seconds: float) -> None:
    filled = int(30 * step / steps)
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] step {step:5d}  loss {loss:.4f}  "
          f"held-out accuracy {accuracy:6.2%}  {seconds:5.1f} s", end="", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digits", type=int, default=6, help="sequence length (default 6)")
    parser.add_argument("--steps", type=int, default=4000, help="at most this many steps")
    parser.add_argument("--plot", default="train_loss.png", help="the loss curve's PNG")
    args = parser.parse_args(argv)
    result = train(args.digits, args.steps, report=_progress)
    print(f"\nheld-out token accuracy {result['accuracy']:.2%} after {result['steps']} steps "
          f"in {result['seconds']:.1f} s")  # fmt: skip
    try:
        import matplotlib.figure
    except ImportError:
        print("no matplotlib: the loss curve is not drawn (pip install matplotlib)")
        return 0
    figure = matplotlib.figure.Figure(figsize=(6, 3.5), layout="constrained")
    ax = figure.subplots()
    ax.plot(result["losses"], linewidth=0.8)
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="reversing digits")
    figure.savefig(args.plot, dpi=100)
    print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
