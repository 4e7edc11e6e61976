"""Sharded checkpoints written in the background: the save starts a host-memory copy of the state and returns.

Notes: docs/internals.md, "lightning_dist/checkpoint_async.py"."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_dist._compat import DCP_STAGER_SINGLE_USE, dcp_async_staging

log = logging.getLogger(__name__)


def local_tensor_bytes(state: Any) -> int:
    """Bytes of the tensors this rank holds in `state` (a DTensor counts its local shard): the staging copy."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, Mapping):
        return sum(local_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_tensor_bytes(v) for v in state)
    return 0


def _storage_ptr(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def clone_buffers(model_state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """`model_state` with each tensor that is not one of `module`'s parameters cloned now.

    The staging copy made in the background may still run during the next forward, which updates buffers in
    place (BatchNorm's running statistics); parameters change only in the optimizer step, which waits for it.
    """
    params = {_storage_ptr(p) for p in module.parameters()}
    return {
        k: v.clone() if isinstance(v, torch.Tensor) and _storage_ptr(v) not in params else v
        for k, v in model_state.items()
    }


class BackgroundWriter:
    """One sharded checkpoint save at a time, in the background; every rank owns one (see the module doc).

    Args:
        timeout: the collective timeout of the writer's process group (the strategy's ``timeout``).
        pinned: stage into pinned host memory (CUDA: faster device-to-host copies).
        background_staging: make the staging copy on a thread of its own (where torch can); False: the save
            returns once the copy is made.
    """

    def __init__(
        self, *, timeout: Optional[timedelta] = None, pinned: bool = False, background_staging: bool = True
    ) -> None:
        self._timeout = timeout
        self._pinned = pinned
        self._background_staging = background_staging and dcp_async_staging()
        self._group: Optional[dist.ProcessGroup] = None
        self._stager: Any = None
        self._used = False  # the stager has staged a save
        self._pending: Optional[Future] = None
        self._staged: Optional[Future] = None  # done once the staging copy of the pending save is made
        self._after: list[Callable[[], None]] = []
        self.path: Optional[Path] = None
        """The checkpoint being written (None when nothing is pending)."""
        self.staging_bytes = 0
        """Host bytes of the last staged state (this rank's shards): held until its write finished."""

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def background_staging(self) -> bool:
        """True when a save returns before its staging copy is made (see :meth:`wait_staged`)."""
        return self._background_staging

    @property
    def staging(self) -> bool:
        """True while the staging copy of the pending save is being made: the saved tensors must not change."""
        return self._staged is not None and not self._staged.done()

    def wait_staged(self) -> None:
        """Block until the staging copy of the pending save is made (at once when none is being made).

        Call before changing a saved tensor in place. A failed copy is not raised here: the save fails, and
        :meth:`wait` raises it (on every rank at the same point).
        """
        staged, self._staged = self._staged, None
        if staged is not None:
            wait_futures([staged])

    def prepare(self) -> None:
        """Create the writer's process group and stager now (every rank, at set-up, as torchtitan does at init),
        so that the first save does not pay for them inside the training loop."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._group is None:
            # the worker thread's collectives get their own group: never interleaved with training's
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        if self._stager is None:
            # one stager for every save: with pinned memory its host buffers are reused, not re-pinned each time
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self._pinned,
                    use_shared_memory=False,
                    use_async_staging=self._background_staging,
                    use_non_blocking_copy=False,
                )
            )

    def start(self, state: dict[str, Any], tmp: Path, path: Path, commit: Optional[Callable[[], None]]) -> None:
        """Stage `state` and write it to `tmp` in the background; then call `commit` (rank 0: the rename).

        Every rank calls this, in the same order (the first call creates the writer's process group). With
        background staging it returns before the copy is made: see :meth:`wait_staged`.
        """
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:
            raise RuntimeError("BackgroundWriter.start: the previous save is still pending; call `wait()` first.")
        if self._stager is not None and DCP_STAGER_SINGLE_USE and self._used:
            self._stager.close()  # this torch's stager serves one save: a new one for each
            self._stager = None
        self.prepare()
        self._used = True
        self.staging_bytes = local_tensor_bytes(state)
        response = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group, async_stager=self._stager)
        upload: Future = getattr(response, "upload_completion", response)  # a Future, or AsyncSaveResponse
        self._staged = getattr(response, "staging_completion", None)  # None: staged before async_save returned
        done: Future = Future()

        def finish(written: Future) -> None:  # runs on DCP's worker thread once every rank has written
            try:
                written.result()
                if commit is not None:
                    commit()
                done.set_result(None)
            except BaseException as err:  # handed to whoever waits
                done.set_exception(err)

        self._pending, self.path = done, path
        upload.add_done_callback(finish)

    def defer(self, action: Callable[[], None]) -> bool:
        """Run `action` after the pending save has been committed (False, and nothing kept, when none is)."""
        if self._pending is None:
            return False
        self._after.append(action)
        return True

    def wait(self, *, raise_errors: bool = True, barrier: bool = True) -> None:
        """Block until the pending save is written and committed, then run the deferred actions.

        Every rank calls this at the same point (a barrier on the writer's group follows a finished save, unless
        `raise_errors` or `barrier` is False; `barrier=False`: the caller's next collective orders the ranks
        behind rank 0's commit).
        `raise_errors=False` (a run that already failed): a failed or timed-out save is logged, not raised.
        """
        pending, after = self._pending, self._after
        if pending is None:
            return
        self._pending, self._after, self._staged = None, [], None  # the write follows the staging copy
        seconds = self._timeout.total_seconds() if self._timeout is not None else None
        try:
            pending.result(timeout=seconds)
        except BaseException as err:
            if raise_errors:
                raise RuntimeError(
                    f"The background checkpoint save of {self.path} failed ({type(err).__name__}:"
                    f" {err}); the previous checkpoint was kept."
                ) from err
            log.warning(
                "The background checkpoint save of %s did not finish (%s); the previous checkpoint was kept.",
                self.path,
                err,
            )
            return
        finally:
            self.path = None
        # rank 0 commits after its own write finished, maybe after the other ranks' writes returned: no rank
        # goes on (to read the checkpoint, or to end the job) before the rename is done. Not in a failed run,
        # where a peer may be gone
        if raise_errors and barrier:
            dist.barrier(group=self._group)
        for action in after:
            action()

    def close(self) -> None:
        """Wait for the pending save and free the staging buffers."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
            self._used = False
        self.staging_bytes = 0
