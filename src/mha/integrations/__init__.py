"""Other libraries' layouts and APIs: PyTorch's ``nn.MultiheadAttention`` state dicts and
functional signature, Hugging Face transformers' layouts, and mha's own ``.npz`` files.

The layout modules work on plain dicts of mha's weight names and never import the API;
``MultiHeadAttention``'s constructors (``from_torch``, ``from_gpt2``, ``load``, ...) call
them. The optional libraries (torch, transformers, safetensors) are imported only inside the
functions that need them.
"""
