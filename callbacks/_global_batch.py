"""The global batch of a step, gathered from the data-parallel ranks (for single-device reference computations).

Batch structures (tensors, mappings, lists, named tuples) are moved, filtered to the real samples (without
``DistributedSampler`` padding), joined along dim 0 and compared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler


def to_cpu(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch.detach().cpu()
    if isinstance(batch, Mapping):
        return {k: to_cpu(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (
            type(batch)(to_cpu(v) for v in batch)
            if not hasattr(batch, "_fields")
            else type(batch)(*(to_cpu(v) for v in batch))
        )
    return batch


def select_rows(batch: Any, keep: Optional[Tensor]) -> Any:
    if keep is None:
        return batch
    if isinstance(batch, Tensor):
        return batch[keep] if batch.dim() > 0 and batch.shape[0] == keep.shape[0] else batch
    if isinstance(batch, Mapping):
        return {k: select_rows(v, keep) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [select_rows(v, keep) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def concat_batches(parts: Sequence[Any]) -> Any:
    """Concatenate the same batch structure from several ranks along dim 0."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(list(parts)) if first.dim() > 0 else first
    if isinstance(first, Mapping):
        return {k: concat_batches([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        items = [concat_batches([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return first


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def padding_keep_mask(trainer: Trainer, batch_idx: int) -> Optional[Tensor]:
    """Rows of this training batch that are real samples (not ``DistributedSampler`` padding), when the
    training loader is a plain DataLoader over a DistributedSampler; None when nothing can be told."""
    dl = trainer.train_dataloader
    if not isinstance(dl, DataLoader):
        return None
    sampler, batch_sampler = dl.sampler, dl.batch_sampler
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or type(batch_sampler) is not BatchSampler:
        return None
    n = len(sampler.dataset)  # type: ignore[arg-type]
    start = batch_idx * batch_sampler.batch_size
    stop = min(start + batch_sampler.batch_size, sampler.num_samples)
    # local position j is global position rank + j * num_replicas; positions >= n repeat earlier samples
    return torch.tensor([sampler.rank + j * sampler.num_replicas < n for j in range(start, stop)])


def same_values(a: Any, b: Any) -> bool:
    """Structural equality of two gathered batches."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


def batch_rows(batch: Any) -> int:
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        return batch_rows(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_rows(batch[0])
    return 0
