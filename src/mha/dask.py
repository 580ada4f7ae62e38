"""``mha.dask``: attention over Dask arrays, parallel over the batch and the sequence.

The public path of :mod:`mha.integrations.dask`, where the code lives. Needs the ``dask``
extra (``pip install ".[dask]"`` in the mha checkout); only its functions import Dask.
"""

from .integrations.dask import multi_head_attention, scaled_dot_product_attention

__all__ = ["multi_head_attention", "scaled_dot_product_attention"]
