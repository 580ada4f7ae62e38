"""What every source of a model's tensors offers (a ``save_pretrained`` folder,
:class:`~.checkpoint.Checkpoint`; a GGUF file, :class:`~.gguf_file.GGUFFile`): its tensors'
names, as a mapping's keys."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["TensorNames"]


class TensorNames(ABC):
    """The names of a source's tensors: :meth:`_where` maps each to where it lies (a shard,
    a GGUF tensor record)."""

    @abstractmethod
    def _where(self) -> Mapping[str, Any]:
        """Each tensor's name and where it lies (each source says)."""

    def keys(self) -> list[str]:
        """The tensors' names, sorted."""
        return sorted(self._where())

    def __contains__(self, name: object) -> bool:
        return name in self._where()

    def __iter__(self) -> Iterator[str]:
        """The tensors' names, in the order of :meth:`keys`."""
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._where())
