"""The kernel under every entry point: the mask contract (:mod:`.contract`), the tiled
FlashAttention-2-style forward pass (:mod:`.forward`) and the thread team with its BLAS
limit (:mod:`.team`). Nothing here imports the public API above it."""
