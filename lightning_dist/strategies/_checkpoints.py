"""The checkpoint side of :class:`~lightning_dist.strategies.base.MeshStrategy`: sharded states, any mesh.

Notes: docs/internals.md, "lightning_dist/strategies/_checkpoints.py"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_dist import checkpoint as ckpt
from lightning_dist.checkpoint_async import BackgroundWriter, clone_buffers


class ShardedCheckpointMixin(ParallelStrategy):
    """Checkpoint hooks of a mesh strategy (expects ``_save_distributed_checkpoint``, set by ``MeshStrategy``)."""

    _save_distributed_checkpoint: bool
    _async_checkpoint: bool = False
    _writer: Optional[BackgroundWriter] = None
    _failed: bool = False
    _stepping: bool = False  # inside an optimizer step, past its closure: the state is about to change

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the parallelized model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer states are loaded by `load_checkpoint`

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return ckpt.model_state(self.model, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        return ckpt.optimizer_state(self.model, optimizer, full=not self._save_distributed_checkpoint)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options (no CheckpointIO).")
        path = self.broadcast(filepath)  # rank 0 decides the path
        writer = self.checkpoint_writer()
        if writer is not None and writer.background_staging and ckpt.MODEL_KEY in checkpoint:
            assert self.model is not None
            checkpoint = {**checkpoint, ckpt.MODEL_KEY: clone_buffers(checkpoint[ckpt.MODEL_KEY], self.model)}
        ckpt.save(checkpoint, path, sharded=self._save_distributed_checkpoint, writer=writer)
        if writer is not None and self._stepping:  # saved between the closure and the update: copy it now
            writer.wait_staged()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        writer = self._writer
        if writer is None or not writer.background_staging:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_staged() -> Any:
            # forward and backward overlapped the background staging copy; the update changes what it copies
            result = closure()
            writer.wait_staged()
            self._stepping = True
            return result

        try:
            return super().optimizer_step(optimizer, closure_then_staged, model, **kwargs)
        finally:
            self._stepping = False

    def checkpoint_writer(self) -> Optional[BackgroundWriter]:
        """The background writer of ``async_checkpoint=True`` (None: saves block until written)."""
        if self._async_checkpoint and self._writer is None:
            self._writer = BackgroundWriter(
                timeout=getattr(self, "_timeout", None), pinned=self.root_device.type == "cuda"
            )
        return self._writer if self._async_checkpoint else None

    def wait_for_checkpoint(self) -> None:
        """Block until a background save is written and committed (no-op without one). After a failure of the
        run, a save that cannot finish is logged instead of raised (the original error stays the one shown)."""
        if self._writer is not None:
            self._writer.wait(raise_errors=not self._failed)
        self._failed = False  # a later fit starts clean

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        # ModelCheckpoint drops an older checkpoint right after starting a newer save: keep it until that one is
        # committed, so a crash mid-write still leaves it
        remove = super().remove_checkpoint
        if self._writer is None or not self._writer.defer(lambda: remove(filepath)):
            remove(filepath)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load model and optimizer states into the parallelized model (any mesh); return Lightning's metadata."""
        path = self.broadcast(checkpoint_path)
        assert self.model is not None and self.lightning_module is not None
        self.wait_for_checkpoint()  # it may be the one being written
        return ckpt.load(
            path,
            model=self.model,
            optimizers=self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=True if weights_only is None else weights_only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """No-op: :meth:`load_checkpoint` already loaded the (sharded) weights."""
        # already loaded in `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """No-op: :meth:`load_checkpoint` already loaded the (sharded) optimizer states."""
        # already loaded in `load_checkpoint`
