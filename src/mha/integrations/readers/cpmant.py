"""CPM-Ant (issue 33): attention that is not causal, with a learned relative-position bias by
segment (:class:`mha.SegmentBiasAttention`). transformers' ``CpmAntAttention`` projects with
``project_q``, ``project_k``, ``project_v`` and ``attention_out`` (no biases, no rope), adds
the bias of ``CpmAntSegmentPositionEmbedding`` (the table ``position_bias.
relative_attention_bias`` that every layer shares, ``position_bias_num_buckets`` buckets of
distances up to ``position_bias_max_distance`` in both directions, and one entry a pair of
its ``segment_types`` segments) and hides only the left padding: every token sees every
token, a prefill of several tokens through the cache included. The layer reads the table,
its buckets and ``prompt_length``, the prompt tokens CPM-Ant's forward prepends.

>>> [row.name for row in ROWS]
['cpmant']
>>> ROWS[0].tensors.kind
'segment_bias'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .config import Settings
from .family import Family
from .layouts import NO_BIASES, Projections, Tensor, whole
from .rules import NO_ROPE

__all__ = ["CPMANT", "ROWS", "SegmentBiasProjections"]

CPMANT: dict[str, Any] = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "dim_head": 128,
    "num_hidden_layers": 48,
    "position_bias_num_buckets": 512,
    "position_bias_max_distance": 2048,
    "segment_types": 32,
    "prompt_length": 32,
}


@dataclass(frozen=True)
class SegmentBiasProjections(Projections):
    """CPM-Ant's projections, and its bias table ``table`` outside the layers (under the
    model's full names; a bare model's checkpoint names it without the first)."""

    kind: ClassVar[str] = "segment_bias"
    table: str = "cpmant.position_bias.relative_attention_bias"

    def shared(self, read: Settings, settings: dict[str, Any]) -> dict[str, Tensor]:
        """The table ``(num_buckets + num_segments**2, heads)``, read as ``relative_bias``."""
        rows = settings["num_buckets"] + settings["num_segments"] ** 2
        return {self.table: whole("relative_bias", rows, settings["num_heads"])}


def _heads(read: Settings) -> tuple[int, int, int]:
    """A key and value a head, ``dim_head`` wide (CPM-Ant's attention has no other)."""
    H = read.positive("num_attention_heads")
    return H, H, read.positive("dim_head")


def _buckets(read: Settings, index: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The bias's buckets and segments, and the prompt's length."""
    prompt = read.get("prompt_length")
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 0:
        raise read.refuse(f"{read.name('prompt_length')}={prompt!r} (not a length)")
    return {
        "num_buckets": read.positive("position_bias_num_buckets"),
        "max_distance": read.positive("position_bias_max_distance"),
        "num_segments": read.positive("segment_types"),
        "prompt_length": prompt,
    }


ROWS: tuple[Family, ...] = (
    Family(
        "cpmant",
        CPMANT,
        heads=_heads,
        tensors=SegmentBiasProjections(
            q="project_q",
            k="project_k",
            v="project_v",
            o="attention_out",
            path="cpmant.encoder.layers.{i}.self_att.self_attention",
        ),
        biases=NO_BIASES,
        rope=NO_ROPE,
        by_layer=_buckets,
    ),
)
