"""Print the census of transformers' causal language models and write it to docs/families.md.

    PYTHONPATH=src python scripts/families.py     # needs torch and transformers; about a minute

Every ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, classified, and
what ``mha.from_pretrained`` does with a tiny random checkpoint of it (tests/support/census.py,
which tests/test_families.py runs): read (every attention layer within 1e-12 of transformers'
own, the worst relative error given), refused (by the feature that blocks it), wrong or
cannot build. The file is replaced whole, or not at all.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from support import census  # noqa: E402

OUTPUT = ROOT / "docs" / "families.md"
HEADER = """# The families of transformers, one by one

Every `model_type` of transformers {version}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, and what
`mha.from_pretrained` does with a tiny random checkpoint of it (4 layers, hidden 48, bfloat16
in shards), written by `scripts/families.py` from the census that `tests/test_families.py`
runs. *read*: every attention layer matches transformers' own attention module of that layer
in float64, whole sequences and prefill then token-by-token decoding, within 1e-12 (the worst
relative error in parentheses); a hybrid model (Mamba, linear-attention or convolution layers
between its attention layers) counts as read when every attention layer reads so and every
other layer is refused by its index, with what it is: "read (attention layers 1, 3 of 4)".
*refused*: mha raises its error, which names what blocks the
family; "it is not supported" marks a family whose attention is not in the table yet. The
classes: a decoder-only text family; an encoder run as a decoder; the decoder of an
encoder-decoder model; a multimodal wrapper (whose text model has its own `model_type`); a
model without attention. How the families are read: [pretrained.md](pretrained.md).

"""


def main() -> None:
    import transformers

    text = HEADER.format(version=transformers.__version__) + census.table(census.census())
    print(text)
    with tempfile.NamedTemporaryFile(
        "w", dir=OUTPUT.parent, suffix=".md", delete=False, encoding="utf-8"
    ) as handle:
        handle.write(text)
    os.replace(handle.name, OUTPUT)
    print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
