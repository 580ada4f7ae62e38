"""A first run: the specification's example, causal masking, padding, and the oracle check.

python examples/quickstart.py
"""

import numpy as np

import mha

rng = np.random.default_rng(0)

# The specification's configuration: Q, K, V of shape (1, 3, 4), four (4, 4) weights, 2 heads.
Q = K = V = rng.standard_normal((1, 3, 4))
W_q, W_k, W_v, W_o = rng.standard_normal((4, 4, 4))
out = mha.multi_head_attention(Q, K, V, W_q, W_k, W_v, W_o, num_heads=2)
print("output", out.shape, out.dtype)
print(out.round(4))

# The class form, causal: the first position can only see itself.
attention = mha.MultiHeadAttention(d_model=4, num_heads=2, seed=0)
out, weights = attention.forward(Q, mask=True, return_weights=True)
print("\ncausal attention weights of head 0 (rows: queries, columns: keys)")
print(weights[0, 0].round(3))

# Variable-length sequences: the second sequence has only 2 real keys; a row that sees no key
# (query_lengths) gets a zero attention output, never NaN.
X = rng.standard_normal((2, 3, 4))
out, weights = attention(X, key_lengths=[3, 2], query_lengths=[3, 1], return_weights=True)
print("\npadded batch: weights of sequence 1, head 0")
print(weights[1, 0].round(3))
print("no NaN anywhere:", not np.isnan(out).any())
