"""ResumeRNG: every rank's RNG states (torch, Python, NumPy, CUDA) saved in checkpoints and restored on resume.

With :class:`lightning_dist.data.ResumableDataLoader` (the data position) it makes a mid-epoch resume
continue exactly as the uninterrupted run would (dropout, augmentation and shuffling streams included).
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dist._compat import numpy_available

__all__ = ["ResumeRNG", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's random states (torch, Python, NumPy, CUDA), in types ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _plain(random.getstate())}
    if numpy_available():
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]  # lists: loadable with weights_only=True
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _plain(obj: Any) -> Any:
    return [_plain(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _tuple(obj: Any) -> Any:
    return tuple(_tuple(x) for x in obj) if isinstance(obj, list) else obj


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuple(state["python"]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class ResumeRNG(Callback):
    """Save every rank's RNG states (torch, Python, NumPy, CUDA) in checkpoints; restore them on resume.

    Each save gathers the states of all ranks (``all_gather_object``: every rank saves, as Lightning
    does for the pack's strategies); on resume each rank restores its own. The world size must match.
    """

    def __init__(self) -> None:
        self._restore: Optional[dict[str, Any]] = None

    @override
    def state_dict(self) -> dict[str, Any]:
        mine = rng_state()
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [mine]}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict["ranks"]
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if len(ranks) != (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1):
            raise ValueError(
                f"ResumeRNG: the checkpoint holds RNG states of {len(ranks)} ranks but this job has"
                " a different world size; resume with the same number of processes, or drop ResumeRNG."
            )
        self._restore = ranks[rank]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # restored last, right before the first resumed batch, so nothing in set-up consumes the stream
        if self._restore is not None:
            set_rng_state(self._restore)
            self._restore = None
