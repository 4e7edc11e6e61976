"""The process side of :class:`~lightning_dist.strategies.base.MeshStrategy`: launcher, process group, barriers.

Lightning's own pieces (its script launcher, cluster environments, ``init_dist_connection``) with the
pack's changes: the job launcher that ends every rank with the job, a loopback-only rendezvous store, a
collective timeout given as seconds, and the process group torn down at exit.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_dist._integrations.lightning import (
    default_process_group_backend_for_device,
    distributed_is_initialized,
    init_dist_connection,
)
from lightning_dist._integrations.torch_distributed import destroy_process_groups_at_exit
from lightning_dist.launcher import JobLauncher, die_with_launcher, record_rank_error
from lightning_dist.rendezvous import job_store


def as_timeout(value: Any, owner: str) -> Optional[timedelta]:
    """`timeout` as a ``timedelta``: seconds as a number, a ``timedelta``, or None (torch's default).

    torch's process-group and store constructors take only ``timedelta`` (a number fails deep inside them with
    "incompatible constructor arguments"); raised on every rank before any process group exists.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(
            f"{owner}(timeout={value!r}): the collective timeout must be seconds as a number or a"
            f" datetime.timedelta, not {type(value).__name__}. E.g. timeout=1800 or timedelta(minutes=30)."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"{owner}(timeout={value!r}): the collective timeout must be a positive, finite number of"
            " seconds (e.g. timeout=1800), or None for torch's default."
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


class ProcessesMixin(ParallelStrategy):
    """Processes, process group and device of a mesh strategy (the first half of ``MeshStrategy``).

    Expects ``_process_group_backend`` and ``_timeout`` (set by ``MeshStrategy.__init__``).
    """

    _process_group_backend: Optional[str]
    _timeout: Optional[timedelta]

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning asks this to inject DistributedSamplers and enable `sync_dist` for custom strategies."""
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            # Lightning's launcher, but no rank outlives the job and any rank's failure fails it
            self._launcher = JobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _setup_distributed(self) -> None:
        die_with_launcher()  # a child rank goes down with the launching process, however that ends
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank
        self._process_group_backend = self._process_group_backend or default_process_group_backend_for_device(
            self.root_device
        )
        device_id = self.root_device if self.root_device.type != "cpu" else None
        # loopback-only store on one machine; per-attempt keys under torchrun restarts (None: env://)
        store = job_store(self.cluster_environment, timeout=self._timeout or default_pg_timeout)
        init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
            store=store,
        )
        destroy_process_groups_at_exit()  # a gloo worker thread would otherwise abort the exit of a healthy job

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # with empty_init the model is built on the meta device and materialized after parallelizing
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        record_rank_error(exception, self.global_rank)  # the launcher (or torchrun) names this rank's error

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
