"""Exact mid-epoch resume: a DataLoader that remembers its position, and per-rank RNG states.

Notes: docs/internals.md, "lightning_dist/data.py"."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader", "samples_per_rank"]


def samples_per_rank(num_samples: int, num_replicas: int, *, drop_last: bool = False) -> int:
    """Samples each rank gets from ``torch.utils.data.DistributedSampler`` (its own arithmetic).

    Without ``drop_last`` the dataset is padded with repeated samples to ``ceil(n / R)`` per rank; with
    it the tail is dropped, ``floor(n / R)``.
    """
    return num_samples // num_replicas if drop_last else -(-num_samples // num_replicas)


class _SkipFirst:
    """Batch-index iterable that drops the first `n` entries of `inner`, once (the resumed pass only)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __iter__(self) -> Iterator:
        n, self.n = self.n, 0  # a later pass (persistent workers reuse this object) starts at the beginning
        return itertools.islice(iter(self.inner), n, None)

    def __len__(self) -> int:
        return len(self.inner) - self.n


class _Counting:
    """Iterator over a DataLoader pass that records how many batches it has handed out."""

    def __init__(self, inner: Iterator, loader: "ResumableDataLoader") -> None:
        self._inner, self._loader = inner, loader

    def __iter__(self) -> "_Counting":
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._loader._position += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch at the batch after the last one handed out before a save.

    Same arguments as ``DataLoader``. Lightning calls :meth:`state_dict` when it saves a checkpoint and
    :meth:`load_state_dict` before the first batch of a resumed fit.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = 0  # batches handed out in the current pass
        self._skip = 0  # batches to skip at the start of the next pass (set by `load_state_dict`)

    @property
    def _index_sampler(self) -> Any:
        # DataLoader iterators draw batch indices from here; the skip applies to indices, not to loaded data
        return _SkipFirst(super()._index_sampler, self._skip)

    def __iter__(self) -> _Counting:
        self._position = self._skip
        try:
            inner = super().__iter__()
        finally:
            self._skip = 0
        return _Counting(inner, self)

    def state_dict(self) -> dict[str, Any]:
        """The position in the current pass (batches handed out)."""
        return {"position": self._position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Skip ``position`` batches at the start of the next pass (none if the saved pass had ended)."""
        position = int(state_dict.get("position", 0))
        self._skip = position if 0 < position < len(self) else 0
