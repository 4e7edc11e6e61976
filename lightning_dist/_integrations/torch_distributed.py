"""torch.distributed: process groups torn down at interpreter exit without a SIGABRT from gloo.

* :func:`destroy_process_groups_for_exit`: flush each gloo worker thread, then ``destroy_process_group``;
  :func:`destroy_process_groups_at_exit` registers it with ``atexit`` once per process. Every strategy of the
  pack calls it once its process group exists: the mesh strategies, and the DeepSpeed offload strategy
  (DeepSpeed leaves its group to interpreter shutdown too).

Reason: a gloo worker thread keeps the last collective it ran (and that collective's tensors) until it runs
the next one. When that work is released during interpreter finalization (the process group is still
referenced by the model's FSDP2 / DTensor state, which Python frees only at exit), dropping a tensor that has
a Python object needs the GIL; Python ends the thread instead (``pthread_exit``), and unwinding through the
work's destructor calls ``std::terminate``: "terminate called without an active exception", exit -6, after
all work had finished. Reproduced here (torch 2.13, 4 gloo processes on 2 busy cores, a group still
referenced at exit): 14 of 15 runs aborted with ``destroy_process_group()`` alone, 0 of 10 with the flush.
A gdb backtrace shows the aborting thread in ``ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork ->
decref_pyobject -> take_gil -> PyThread_exit_thread``. Upstream: pytorch/pytorch#190489 (same abort when a
group is not destroyed) and the abandoned atexit fix pytorch/pytorch#179291.

The flush runs barriers (no tensors) on every gloo group, in creation order: every rank created the groups
in the same order, so all ranks meet in each group without deadlock. Each barrier replaces the work a worker
held; with the default two worker threads per group, four rounds reach both.

* :func:`clear_dtensor_sharding_cache`: every parallelization starts with DTensor's sharding caches empty (below).

It reads torch's private group registry (``distributed_c10d._world``) because there is no public list of a
process's groups; :data:`lightning_dist._compat.TORCH_GROUP_REGISTRY` says whether it has the shape relied
on, and without it the flush is skipped (plain ``destroy_process_group``). Test:
``tests/unit/test_integrations.py``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist._compat import DTENSOR_CACHE_CLEAR, TORCH_GROUP_REGISTRY, check_torch_internals

__all__ = [
    "build_replicate_reducers",
    "clear_dtensor_sharding_cache",
    "ddp_on_fake_process_group",
    "destroy_process_groups_at_exit",
    "destroy_process_groups_for_exit",
    "gloo_groups",
]

FLUSH_ROUNDS = 4
_AT_EXIT: list[bool] = []  # registered already in this process


def gloo_groups() -> list[Any]:
    """This process's process groups that have a gloo backend, in creation order (empty when unknown)."""
    if not TORCH_GROUP_REGISTRY or not dist.is_initialized():
        return []
    groups = []
    for group in list(dist.distributed_c10d._world.pg_map):  # insertion order = creation order
        try:
            backend = group._get_backend(torch.device("cpu"))
        except (RuntimeError, ValueError):  # no CPU (gloo) backend in this group, e.g. NCCL only
            continue
        if backend.name().lower() == "gloo":
            groups.append(group)
    return groups


def clear_dtensor_sharding_cache() -> None:
    """Empty DTensor's sharding-propagation caches (the C++ dispatch fast path's and Python's).

    Reason: on torch 2.13-2.14 the fast path's key does not tell a Python float from a 0-dim tensor argument. After a
    vocab-parallel embedding's output times a float (BioGPT's scale), the same op times a 0-dim tensor (Gemma's) reuses
    the cached plan and fails with "'float' object has no attribute 'mesh'": a second model trained in one process was
    refused for a reason of torch's (torch 2.11 is not affected). Upstream: no issue found. Private names: torch's
    ``_clear_DTensor_sharding_propagator_cache`` (:data:`~lightning_dist._compat.DTENSOR_CACHE_CLEAR`) and the
    dispatcher's Python LRU cache; a torch without them is left as it is. Test: ``tests/unit/test_integrations.py``.
    """
    if DTENSOR_CACHE_CLEAR:
        torch._C._clear_DTensor_sharding_propagator_cache()
    from torch.distributed.tensor import DTensor

    cache = getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    getattr(cache, "cache_clear", lambda: None)()


def _cpu_barrier() -> Any:
    """Barrier options that select the group's CPU (gloo) backend, also where NCCL serves CUDA tensors."""
    opts = dist.distributed_c10d.BarrierOptions()
    opts.device = torch.device("cpu")
    return opts


def destroy_process_groups_for_exit(*, rounds: int = FLUSH_ROUNDS) -> None:
    """Destroy every process group while Python still runs, after flushing gloo's worker threads (see above).

    Call on every rank at the end of a healthy run (an ``atexit`` handler does). When the process is exiting
    with an uncaught exception, peers may never arrive: the flush is skipped and the groups are only destroyed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if getattr(sys, "last_value", None) is None:  # set by Python when an uncaught exception ended the script
        try:
            for group in gloo_groups():
                for _ in range(rounds):
                    group.barrier(opts=_cpu_barrier()).wait()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to flush with, destroy anyway
            pass
    dist.destroy_process_group()


def destroy_process_groups_at_exit() -> None:
    """Have :func:`destroy_process_groups_for_exit` run at interpreter exit, once per process.

    Lightning keeps the process groups alive after fit (a later fit reuses them), and DeepSpeed never destroys
    its own; left to interpreter shutdown, a gloo worker thread aborts the process after all work had finished
    ("terminate called without an active exception", exit -6), failing a healthy job.
    """
    import atexit

    if not _AT_EXIT:
        atexit.register(destroy_process_groups_for_exit)
        _AT_EXIT.append(True)


@contextlib.contextmanager
def ddp_on_fake_process_group() -> Iterator[None]:
    """Let torch's DDP reducer (composable ``replicate``, ``DistributedDataParallel``) run on torch's fake process
    group with fake tensors: the dry run of replicated layouts (hsdp ``shard_size=1``, ``zero_stage=1``).

    Reasons (upstream: no issue found), two places where DDP needs values a fake group does not deliver:

    - ``DistributedDataParallel.__init__`` checks that every rank's parameter shapes agree by reading the
      parameters' data (``_verify_param_shape_across_processes``), which fake tensors do not hold: skipped (every
      simulated rank builds the same model from the same config);
    - the reducer requires its communication hook's future to hold the reduced bucket, and the fake group's
      ``allreduce`` future holds none: each DDP built meanwhile gets the hook DDP's default one does, the bucket
      divided by the group size and all-reduced (the same ``c10d.allreduce_`` call on the same bucket, which the
      collective recorder counts as a real run's), its future completed with the bucket.
    """
    check_torch_internals("ddp_on_fake_process_group (DDP's shape check and communication hook)")
    from torch.nn.parallel import distributed as ddp_module

    def allreduce_bucket(group, bucket):  # unannotated: DDP checks a hook's annotations against its own types
        buffer = bucket.buffer()
        buffer.div_(group.size())
        dist.all_reduce(buffer, group=group)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    init, verify = ddp_module.DistributedDataParallel.__init__, ddp_module._verify_param_shape_across_processes

    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.register_comm_hook(self.process_group, allreduce_bucket)

    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    ddp_module.DistributedDataParallel.__init__ = patched_init
    try:
        yield
    finally:
        ddp_module.DistributedDataParallel.__init__ = init
        ddp_module._verify_param_shape_across_processes = verify


def build_replicate_reducers(model: Any) -> None:
    """Build the DDP reducer of each composable ``replicate`` module of `model` now; torch builds it at the first
    forward. Reason: the dry run (:func:`ddp_on_fake_process_group`) keeps DDP's one-time set-up (its parameter
    broadcast from rank 0) out of the step it measures, as a real run's steady step has none; a second DDP step cannot
    run on the fake group (the bucket rebuild reads tensor data). Reads composable ``replicate``'s private state
    (``_init_args``, ``lazy_init``). A model without ``replicate`` is left as it is."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed._composable.replicate import replicate

    modules = [m for m in model.modules() if "replicate" in (_get_registry(m) or {})]
    if modules:
        check_torch_internals("build_replicate_reducers (composable replicate's lazy set-up)")
    for module in modules:
        state = replicate.state(module)
        if state._init_args:  # not built yet
            state.lazy_init()
