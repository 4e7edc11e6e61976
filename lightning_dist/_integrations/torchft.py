"""torchft: every call the pack makes into it, as small named functions (fault-tolerant replica groups).

* :func:`start_lighthouse` / :func:`check_lighthouse`: the embedded lighthouse, and the reachability check;
* :func:`make_manager`: one ``torchft.Manager`` per replica group, over a reconfigurable process group;
* :func:`average_across_replica_groups`: FSDP2's post-reduce hook, or DDP's comm hook, through the manager's
  all-reduce; :func:`replicate_for_replica_groups`: DDP for a group of one data-parallel rank;
  :func:`average_gradients`: the same average called after a backward (a pipeline's schedule);
* :func:`register_state`: the state a healing replica group receives from a healthy one;
* :class:`CommitGate`: Lightning's optimizer closure, then torchft's optimizer wrapper (step only on commit);
* :func:`diloco`: torchft's ``DiLoCo`` over the whole module (``sync="diloco"``: no per-step average);
  :func:`diloco_global_weights` / :func:`set_diloco_inner_step`: what a checkpoint saves and restores of it;
* :func:`continue_fit_loop`: Lightning's side of a heal, the healthy group's loop progress taken over mid-epoch.

Only public torchft API (``torchft.Manager``, ``torchft.Optimizer``, ``torchft.coordination``,
``torchft.local_sgd.DiLoCo``) but for DiLoCo's global weights and sync counter (:func:`diloco_global_weights`,
:func:`set_diloco_inner_step`); the entry points
(the lighthouse, the manager) check :data:`lightning_dist._compat.TORCHFT_RANGE`; :func:`continue_fit_loop` reaches
into Lightning's loop (checked against ``LIGHTNING_RANGE``). Notes: docs/fault_tolerance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import nn

from lightning_dist._compat import require_torchft

__all__ = [
    "CommitGate",
    "average_across_replica_groups",
    "average_gradients",
    "check_lighthouse",
    "continue_fit_loop",
    "diloco",
    "diloco_global_weights",
    "make_manager",
    "register_state",
    "replicate_for_replica_groups",
    "set_diloco_inner_step",
    "start_lighthouse",
]


def start_lighthouse(*, port: int, min_replicas: int, join_timeout: float) -> Any:
    """torchft's in-process ``LighthouseServer`` on ``127.0.0.1:port`` (one machine). Returns the server (keep it
    referenced: it stops when collected or ``shutdown()``)."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(
            bind=f"127.0.0.1:{port}", min_replicas=min_replicas, join_timeout_ms=int(join_timeout * 1000)
        )
    except Exception as err:  # a busy port: name it and the fix
        raise RuntimeError(
            f"Cannot start the embedded torchft lighthouse on 127.0.0.1:{port} ({err}). Another job uses the port:"
            " pass FaultTolerance(lighthouse_port=<a free port>) to every replica group, or run `torchft_lighthouse`"
            " yourself and pass its address."
        ) from err


def check_lighthouse(address: str, *, timeout: float, who: str) -> None:
    """RuntimeError naming `address` unless a torchft lighthouse answers there within `timeout` seconds
    (torchft's client retries the connection until then)."""
    require_torchft()
    from torchft.coordination import LighthouseClient

    try:
        # connecting is the whole check: a heartbeat would make the lighthouse wait for a replica that never joins
        LighthouseClient(address, connect_timeout=timedelta(seconds=timeout))
    except Exception as err:
        raise RuntimeError(
            f"{who}: the torchft lighthouse at {address} did not answer within {timeout:g} s ({err}). Start it"
            " (`torchft_lighthouse --min_replicas <N> --bind [::]:<port>`, see docs/fault_tolerance.md) and pass its"
            " address as FaultTolerance(lighthouse=...) or the TORCHFT_LIGHTHOUSE environment variable, or raise"
            " FaultTolerance(connect_timeout=...)."
        ) from err


def make_manager(
    *,
    replica_group: int,
    group_rank: int,
    group_size: int,
    store_addr: str,
    store_port: int,
    lighthouse: str,
    min_replicas: int,
    device_type: str,
    timeout: float,
    quorum_timeout: float,
    connect_timeout: float,
) -> Any:
    """A ``torchft.Manager`` for this rank of replica group `replica_group`: its group rank 0 runs the manager
    server that asks the lighthouse for the quorum; the cross-group all-reduce runs on torchft's reconfigurable
    gloo (CPU) or NCCL (CUDA) process group. Quorums are synchronous, so a healing group loads the healthy state
    before its forward and trains its own batch in that step."""
    require_torchft()
    import torchft

    seconds = timedelta(seconds=timeout)
    pg = torchft.ProcessGroupNCCL(timeout=seconds) if device_type == "cuda" else torchft.ProcessGroupGloo(seconds)
    return torchft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,  # registered per key by `register_state`
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=seconds,
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=connect_timeout),
        rank=group_rank,
        world_size=group_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"lightning_dist_{replica_group}",  # torchft reads the group's index from the trailing digits
    )


def average_across_replica_groups(model: nn.Module, manager: Any) -> int:
    """Average every gradient over the participating replica groups through ``manager.allreduce``: each FSDP2
    module's reduced shard (FSDP2's all-reduce hook on the group's 1-D shard mesh, torchtitan's way), each
    DDP-replicated root's gradient buckets (a DDP comm hook, torchft's ``DistributedDataParallel`` way). Returns the
    number of modules hooked."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    def shard_hook(reduced: Any) -> None:
        manager.allreduce(reduced).wait()  # average over the quorum; a failed peer marks the step uncommitted

    def bucket_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none, or GradBucket)
        manager.allreduce(bucket.buffer()).wait()
        done: Any = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    hooked = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(shard_hook)
        elif isinstance(module, DDP):
            module.register_comm_hook(None, bucket_hook)
        else:
            continue
        hooked += 1
    return hooked


def average_gradients(grads: Sequence[torch.Tensor], manager: Any) -> int:
    """Average `grads` in place over the participating replica groups through ``manager.allreduce``: each DTensor's
    local shard (every group holds the same shards), in flat buffers per dtype and device (one call each, as DDP's
    buckets; :func:`lightning_dist.parallelize.sync.in_flat_buckets`). Returns the number of calls."""
    from torch.distributed.tensor import DTensor

    from lightning_dist.parallelize.sync import in_flat_buckets

    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    # a failed peer marks the step uncommitted (torchft records the error; the wait returns)
    return in_flat_buckets(local, lambda flat: manager.allreduce(flat).wait())


def replicate_for_replica_groups(roots: list[nn.Module], group: Any) -> None:
    """DDP-style replication of each root over `group` (a replica group of one data-parallel rank: one bucketed
    cross-group all-reduce per step, plain tensors for the optimizer's foreach kernels).

    ``find_unused_parameters=True``, as torchft's own ``DistributedDataParallel``: DDP then never rebuilds its
    buckets, which a group healing at step n (first step: initial buckets) would otherwise lay out differently from
    its peers (rebuilt after their first step).

    One bucket per root (``bucket_cap_mb`` its gradients' size; without a cap DDP's first bucket is 1 MiB): the hook
    waits for each bucket's all-reduce, so further buckets overlap nothing and each costs torchft's per-call work."""
    from torch.distributed._composable import replicate

    for module in roots:
        size = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        replicate(module, process_group=group, find_unused_parameters=True, bucket_cap_mb=max(1, size / 2**20 + 1))


def register_state(manager: Any, key: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
    """Send `state()` to a healing replica group, which applies it with `load` (torchft's checkpoint transport)."""
    manager.register_state_dict_fn(key, load, state)


class CommitGate:
    """What Lightning's precision plugin steps: runs the closure (forward, backward, the cross-group all-reduce,
    clipping), then ``torchft.Optimizer.step``, which steps `optimizer` only if the quorum commits the step.

    torchft's wrapper takes no closure; Lightning always passes one. Built once per optimizer; ``committed`` is the
    last step's vote (None before the step's vote).
    """

    def __init__(self, optimizer: Any, manager: Any) -> None:
        import torchft

        self.optimizer = optimizer
        self._wrapped = torchft.Optimizer(manager, optimizer)
        self.committed: Optional[bool] = None

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        manager = self._wrapped.manager
        before = manager.current_step()
        self._wrapped.step()
        self.committed = manager.current_step() > before
        return result

    @property
    def param_groups(self) -> list:
        return self._wrapped.param_groups

    @property
    def state(self) -> Any:
        return self._wrapped.state


def diloco(manager: Any, module: nn.Module, inner: Any, outer: Any, sync_every: int) -> Any:
    """torchft's ``DiLoCo`` over `module` as one fragment, a context manager: entered, its hooks on the `inner`
    optimizer sync after every `sync_every`-th step (the quorum, the pseudo-gradients averaged by
    ``manager.allreduce``, the commit vote, then `outer` steps the global weights, kept on the CPU between syncs).
    It registers its own heal state with the manager (the global weights and `outer`'s state)."""
    require_torchft()
    from torchft.local_sgd import DiLoCo

    return DiLoCo(manager, [module], inner, outer, sync_every=sync_every)


def diloco_global_weights(sync: Any) -> dict[str, torch.Tensor]:
    """The live global (last synced) weights of `sync` (what :func:`diloco` returned), by parameter name: this rank's
    local shard of each, on the CPU; copy into them to restore."""
    # Reason: torchft keeps them only in its private per-fragment `original_parameters` (no accessor; its own
    # save_fn is registered with the manager, not exposed); :func:`diloco` makes one fragment
    (fragment,) = sync._fragments
    return fragment.original_parameters


def set_diloco_inner_step(sync: Any, step: int) -> None:
    """Set `sync`'s inner steps since its last sync (what decides when the next one runs) to `step`."""
    # Reason: torchft counts them in its private `_local_step` (reset at each sync), with no setter
    sync._local_step = step


def continue_fit_loop(trainer: Any, state: dict) -> None:
    """Take over another replica group's ``trainer.fit_loop.state_dict()`` at the same point of the loop (inside
    the read of a training batch, or under DiLoCo inside the optimizer step of a sync): its counters (global step,
    epoch, batch index), not a restart.

    Reason: ``Loop.load_state_dict`` is public but marks the loops as restarting from a checkpoint (Lightning would
    then replay hooks and skip the epoch-end LR step), and the loop's data fetcher counts the batches it has read
    in its private ``_data_fetcher.fetched``, from which Lightning tells the epoch's last batch; a healed group's
    count starts where the healthy group's is, as Lightning's own mid-epoch resume sets it.
    """
    from lightning_dist._compat import require_tested_lightning

    require_tested_lightning("FitLoop._data_fetcher.fetched after a heal (continue_fit_loop)")
    loop = trainer.fit_loop
    loop.load_state_dict(state)
    loop.restarting = False  # the same point of the same loop: nothing to replay
    fetcher = getattr(loop, "_data_fetcher", None)
    if fetcher is not None:
        # the batches read: in a read, this read adds the batch being read; in a step, `ready` counts its batch
        fetcher.fetched = loop.epoch_loop.batch_progress.current.ready
