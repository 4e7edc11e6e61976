"""``FaultTolerance``: the configuration of fault-tolerant replica groups (``fault_tolerance=``), checked before any
process group exists, every problem listed at once. The strategy's side is ``fault_tolerance.py``.
Notes: docs/fault_tolerance.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_dist.strategies.diloco import outer_optimizer_factory

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse's address
SYNC_EVERY = 100  # DiLoCo's default inner steps per sync: torchft's example (the DiLoCo paper uses 500)


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """Fault-tolerant replica groups with torchft: ``HybridShardStrategy(dp_replicate=N, fault_tolerance=...)``."""

    replica_group: int
    """This job's replica group, 0 .. dp_replicate - 1 (each replica group is its own launched job)."""
    lighthouse: Optional[str] = None
    """The lighthouse's address (``http://host:29510``). None: the ``TORCHFT_LIGHTHOUSE`` environment variable, else
    a lighthouse embedded in replica group 0 on this machine, at ``http://127.0.0.1:<lighthouse_port>``."""
    lighthouse_port: int = 29510
    """The embedded lighthouse's port (one machine only)."""
    min_replicas: int = 1
    """The fewest replica groups a step commits with; also the embedded lighthouse's quorum size (set it to
    dp_replicate to start every group's first step together)."""
    timeout: float = 60.0
    """Seconds for the cross-group all-reduce, the commit vote and the healing transfer."""
    quorum_timeout: float = 60.0
    """Seconds a step waits for its quorum from the lighthouse before the job fails."""
    connect_timeout: float = 30.0
    """Seconds to reach the lighthouse at start-up before the job fails with its address."""
    join_timeout: float = 60.0
    """The embedded lighthouse's wait for heartbeating groups that have not asked for the quorum yet."""
    sync: str = "step"
    """``"step"``: every step averages the gradients across the groups (the result of plain hsdp). ``"diloco"``: the
    groups train on their own and every ``sync_every`` steps torchft's DiLoCo averages the pseudo-gradients (global
    weights - local weights) and the outer optimizer steps the global weights (docs/fault_tolerance.md, DiLoCo)."""
    sync_every: Optional[int] = None
    """DiLoCo's inner steps between two syncs (H); None: :data:`SYNC_EVERY`. Only with ``sync="diloco"``."""
    outer_optimizer: Optional[Callable[[Iterable[Any]], torch.optim.Optimizer]] = None
    """DiLoCo's outer optimizer: a ``torch.optim.Optimizer`` class, a factory ``params -> optimizer``, or (YAML)
    ``{"class_path": "torch.optim.SGD", "init_args": {...}}``. None: SGD, lr 0.7, momentum 0.9, Nesterov (the DiLoCo
    paper's). Only with ``sync="diloco"``."""

    def problems(self, dp_replicate: Any) -> list[str]:
        """Every configuration problem, in words with the values (none: empty)."""
        out = []
        if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
            out.append(
                f"fault_tolerance needs `dp_replicate` to be the number of replica groups (an integer >= 1), not"
                f" {dp_replicate!r}: each replica group is its own job, e.g. dp_replicate=2."
            )
            dp_replicate = None
        group = self.replica_group
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            out.append(f"`FaultTolerance(replica_group={group!r})` must be an integer >= 0 (this job's group).")
        elif dp_replicate is not None and group >= dp_replicate:
            out.append(
                f"`FaultTolerance(replica_group={group})` is outside dp_replicate={dp_replicate}: the groups are"
                f" 0 .. {dp_replicate - 1}."
            )
        low = self.min_replicas
        if isinstance(low, bool) or not isinstance(low, int) or low < 1:
            out.append(f"`FaultTolerance(min_replicas={low!r})` must be an integer >= 1.")
        elif dp_replicate is not None and low > dp_replicate:
            out.append(
                f"`FaultTolerance(min_replicas={low})` exceeds dp_replicate={dp_replicate}: no step could commit."
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout", "join_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                out.append(f"`FaultTolerance({name}={value!r})` must be a positive number of seconds.")
        port = self.lighthouse_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            out.append(f"`FaultTolerance(lighthouse_port={port!r})` must be a port number, 1 .. 65535.")
        if self.lighthouse is not None and (
            not isinstance(self.lighthouse, str) or not self.lighthouse.startswith(("http://", "https://"))
        ):
            out.append(
                f"`FaultTolerance(lighthouse={self.lighthouse!r})` must be the lighthouse's URL, e.g."
                " 'http://lighthouse-host:29510', or None."
            )
        return out + self._sync_problems(dp_replicate)

    def _sync_problems(self, dp_replicate: Optional[int]) -> list[str]:
        if self.sync not in ("step", "diloco"):
            return [f"`FaultTolerance(sync={self.sync!r})` must be 'step' (every step) or 'diloco' (every sync_every)."]
        if self.sync == "step":
            given = [
                f"{n}={getattr(self, n)!r}" for n in ("sync_every", "outer_optimizer") if getattr(self, n) is not None
            ]
            if given:
                return [f"`FaultTolerance({', '.join(given)})` applies to sync='diloco' only: pass sync='diloco'."]
            return []
        out = []
        every = self.sync_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            out.append(
                f"`FaultTolerance(sync_every={every!r})` must be an integer >= 1 (DiLoCo's inner steps per sync)."
            )
        if dp_replicate is not None and dp_replicate < 2:
            out.append(
                f"sync='diloco' averages pseudo-gradients across replica groups; dp_replicate={dp_replicate} has one."
                " Pass dp_replicate >= 2 (one job per group), or sync='step'."
            )
        try:
            outer_optimizer_factory(self.outer_optimizer)
        except (TypeError, ValueError, ImportError) as err:
            out.append(str(err))
        return out

    @property
    def diloco(self) -> bool:
        return self.sync == "diloco"

    @property
    def inner_steps(self) -> int:
        """DiLoCo's inner steps per sync, the default filled in."""
        return self.sync_every or SYNC_EVERY


FaultToleranceArg = Union[FaultTolerance, Mapping[str, Any], None]


def as_fault_tolerance(value: FaultToleranceArg) -> tuple[Optional[FaultTolerance], list[str]]:
    """(the option as a :class:`FaultTolerance`, problems): a dict (LightningCLI YAML) is read by field name."""
    if value is None or isinstance(value, FaultTolerance):
        return value, []
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(FaultTolerance)}
        unknown = sorted(set(value) - names)
        if unknown or "replica_group" not in value:
            why = f"unknown keys {unknown}" if unknown else "no 'replica_group'"
            return None, [f"`fault_tolerance={dict(value)!r}`: {why}; the keys are {sorted(names)}."]
        return FaultTolerance(**value), []
    return None, [
        f"`fault_tolerance={value!r}` must be a FaultTolerance(replica_group=...) or a dict of its fields, or None."
    ]
