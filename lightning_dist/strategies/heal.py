"""Lightning's side of a heal (torchft's live state transfer), and the training loader that reads each batch after
the step's quorum, so that a group healing there reads the batch of the step it joins.

A healing group receives the state of an exact resume: this rank's model and optimizer shards
(``parallelize/shard_state.py``, no Lightning there), and from here Lightning's loop progress, the LR schedulers, the
loaders' positions and the RNG states (under DiLoCo, also DiLoCo's own: the global weights and the outer optimizer's
state). Notes: docs/fault_tolerance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# ---- the training loader: a quorum before each batch, a position that a heal can move ------------------------


class GroupLoader:
    """A replica group's training loader: calls ``before_batch()`` (the step's quorum, where a group heals) before
    reading each batch, and counts the batches of the current pass, so that a heal can move it to the healthy
    group's position. Sized loaders only: Lightning then reads each batch when its step starts (no prefetch).
    Other attributes (``sampler``, ``dataset``, ...) are the wrapped loader's."""

    _OWN = frozenset({"loader", "position", "_before_batch", "_batches"})

    def __init__(self, loader: Any, before_batch: Callable[[], None]) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "_before_batch", before_batch)
        object.__setattr__(self, "_batches", None)
        object.__setattr__(self, "position", 0)
        """Batches handed out in the current pass."""

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> GroupLoader:
        # the wrapped iterator starts now, as it would unwrapped (a DataLoader draws its base seed here)
        object.__setattr__(self, "_batches", iter(self.loader))
        object.__setattr__(self, "position", 0)
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            raise TypeError("GroupLoader: call iter() first")
        self._before_batch()
        batch = next(self._batches)
        object.__setattr__(self, "position", self.position + 1)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "loader"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning sets e.g. `worker_init_fn` on the loader it was handed
        setattr(self.loader, name, value)

    def position_state(self) -> dict[str, Any]:
        """Where the current pass is: batches handed out, and the wrapped loader's own state if it has one."""
        stateful = hasattr(self.loader, "state_dict") and hasattr(self.loader, "load_state_dict")
        return {"position": self.position, "loader": self.loader.state_dict() if stateful else None}

    def seek(self, state: dict[str, Any], *, epoch: int, same_epoch: bool) -> None:
        """Continue the current pass where `state` (another group's :meth:`position_state`) is, in `epoch`: a
        stateful loader (``ResumableDataLoader``, torchdata's ``StatefulDataLoader``) restores its state and skips
        by index; any other reads and drops the batches before the position."""
        from lightning_dist._integrations.lightning import set_sampler_epoch

        position = state["position"]
        if same_epoch and position == self.position:
            return  # already there (every group's first step, or a live group healing after its own failed step)
        set_sampler_epoch(self.loader, epoch)
        if state["loader"] is not None:
            self.loader.load_state_dict(state["loader"])
            batches = iter(self.loader)
        else:
            batches = iter(self.loader)
            for _ in range(position):
                next(batches)
        object.__setattr__(self, "_batches", batches)
        object.__setattr__(self, "position", position)

    def __repr__(self) -> str:
        return f"GroupLoader({self.loader!r}, position={self.position})"


class StatefulGroupLoader(GroupLoader):
    """A :class:`GroupLoader` around a loader with ``state_dict`` / ``load_state_dict``: Lightning's checkpoints keep
    saving and restoring the wrapped loader's state."""

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def group_loader(loader: Any, before_batch: Callable[[], None]) -> GroupLoader:
    stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
    return (StatefulGroupLoader if stateful else GroupLoader)(loader, before_batch)


def group_loaders(trainer: Any) -> list[GroupLoader]:
    """The trainer's current training loaders (each a :class:`GroupLoader`), in order."""

    def flat(x: Any) -> Iterator[Any]:
        if isinstance(x, dict):
            for v in x.values():
                yield from flat(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from flat(v)
        else:
            yield x

    return [loader for loader in flat(trainer.train_dataloader) if isinstance(loader, GroupLoader)]


# ---- Lightning's side of an exact resume: loop progress, LR schedulers, loader positions, RNG states ----------


def training_state(trainer: Any) -> dict[str, Any]:
    """What a healthy group sends besides model and optimizer (called by torchft while the group's main thread
    waits for its quorum, between two steps)."""
    from lightning_dist.callbacks.resume_rng import rng_state

    loop = trainer.fit_loop.state_dict()
    # the loaders' states travel in "data", each with its position
    loop["state_dict"] = {k: v for k, v in loop["state_dict"].items() if k != "combined_loader"}
    return {
        "loop": loop,
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "data": [loader.position_state() for loader in group_loaders(trainer)],
        "rng": rng_state(),
    }


def load_training_state(trainer: Any, state: dict[str, Any]) -> None:
    """Continue from a healthy group's :func:`training_state`, at the same point of the loop (a batch being read)."""
    from lightning_dist._integrations.torchft import continue_fit_loop
    from lightning_dist.callbacks.resume_rng import set_rng_state

    schedulers, loaders = trainer.lr_scheduler_configs, group_loaders(trainer)
    if len(schedulers) != len(state["schedulers"]) or len(loaders) != len(state["data"]):
        raise RuntimeError(
            f"The healthy replica group has {len(state['schedulers'])} LR schedulers and {len(state['data'])}"
            f" training loaders, this one {len(schedulers)} and {len(loaders)}: every replica group must run the same"
            " LightningModule and data."
        )
    epoch_before = trainer.fit_loop.epoch_progress.current.processed
    continue_fit_loop(trainer, state["loop"])
    for config, sched in zip(schedulers, state["schedulers"]):
        config.scheduler.load_state_dict(sched)
    epoch = trainer.fit_loop.epoch_progress.current.processed  # the sampler's epoch, as Lightning sets it
    for loader, position in zip(loaders, state["data"]):
        loader.seek(position, epoch=epoch, same_epoch=epoch == epoch_before)
    set_rng_state(state["rng"])  # last: moving a loader may start its iterator or read batches, which draw from it
