"""CommunicationLedger: every collective of every training step, by operation and mesh dim, next to the plan.

Notes: docs/internals.md, "callbacks/ledger.py"."""

from __future__ import annotations

import io
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from lightning_dist import planner
from lightning_dist.callbacks import _planned

# c10d op name -> (ledger op, argument holding the payload tensor(s): the output of gathers, input of scatters)
# c10d ops: the process group is a positional ScriptObject; functional ops: a group name (or object) last.
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a collective's argument (a tensor or a list of them)."""
    sizes: list[int] = []
    apply_to_collection(obj, torch.Tensor, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


class CollectiveRecorder(TorchDispatchMode):
    """Records ``(op, group ranks, payload bytes)`` for every collective dispatched while it is active.

    Use as ``with CollectiveRecorder() as rec: ...``. The pack's one recorder: :class:`CommunicationLedger`
    (a real run) and the dry run (:mod:`lightning_dist.dryrun`, on torch's fake process group and fake
    tensors) both count with it, so their op names, payloads and dim labels are the same. Calls go through
    unchanged; only the bytes and the group are read.

    Args:
        outside: the dim name of a process group c10d does not know (not made by ``init_process_group`` or
            ``new_group``): under ``fault_tolerance=``, torchft's across the replica groups (``replica_group``).
    """

    def __init__(self, *, outside: str = "unregistered") -> None:
        super().__init__()
        self.outside = outside
        self.calls: list[tuple[str, tuple[int, ...] | str, int]] = []
        """``(op, the group's ranks, or `outside` for a group c10d does not know, payload bytes)`` per call."""
        self.outside_size = 0
        """Ranks in the last `outside` group seen (torchft's: the replica groups in the step's quorum)."""
        self._ranks: dict[str, tuple[int, ...]] = {}
        # per group object, not per name: torchft builds a new group object when the quorum changes (that one is
        # resolved again), and c10d's refusal of a group it does not know is asked once per object, not per call
        self._pg_ranks: weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[int, ...] | str] = (
            weakref.WeakKeyDictionary()
        )

    @staticmethod
    def _resolve(group_name: str) -> tuple[int, ...]:
        """The ranks c10d knows for the group named `group_name` (raises for a group it does not know)."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))

    def _group_ranks(self, group: Any) -> tuple[int, ...] | str:
        if isinstance(group, str):  # functional collectives: a name c10d resolved to run the op
            if group not in self._ranks:
                try:
                    self._ranks[group] = self._resolve(group)
                except (RuntimeError, ValueError):  # never raise inside a collective: torchft would fail the step
                    return self.outside
            return self._ranks[group]
        pg = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
        ranks = self._pg_ranks.get(pg)
        if ranks is None:
            try:
                ranks = self._resolve(pg.group_name)
            except (RuntimeError, ValueError):  # never raise inside a collective: torchft would fail the step
                ranks = self.outside
            self._pg_ranks[pg] = ranks
        if isinstance(ranks, str):
            self.outside_size = pg.size()  # read at each call: the group's size is the step's quorum
        return ranks

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns == "c10d" and name in _C10D:
            op, idx = _C10D[name]
            nbytes = _nbytes(args[idx])
            # the group follows the tensor argument(s): position 1, or 2 when outputs and inputs come first
            group = args[2] if isinstance(args[1], (torch.Tensor, list, tuple)) else args[1]
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            op = _FUNCTIONAL[name]
            nbytes = _nbytes(args[0])
            if op == "all_gather":  # payload = gathered output = input x group size
                nbytes *= int(args[1])
            group = kwargs.get("group_name", args[-1])
        else:
            return
        self.calls.append((op, self._group_ranks(group), nbytes))

    def totals(self, *, mesh: Any, rank: int, world: int, ep: int = 1) -> dict[tuple[str, str], list[int]]:
        """``{(op, dim): [calls, payload bytes]}`` of the recorded calls, each group named by the mesh dim whose
        group it is (:func:`~lightning_dist.callbacks._planned.group_label`: ``tp``, ``dp_shard``, with `ep` > 1
        ``ep``... else ``world`` or its ranks). ``mesh``: the strategy's :class:`~lightning_dist.mesh.DistMesh` or
        None."""
        out: dict[tuple[str, str], list[int]] = {}
        for op, ranks, nbytes in self.calls:
            label = self._label(ranks, mesh=mesh, rank=rank, world=world, ep=ep)
            entry = out.setdefault((op, label), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        return out

    def group_sizes(self, *, mesh: Any, rank: int, world: int, ep: int = 1) -> dict[str, int]:
        """Ranks in each group label of :meth:`totals`."""
        return {
            self._label(ranks, mesh=mesh, rank=rank, world=world, ep=ep): (
                self.outside_size if isinstance(ranks, str) else len(ranks)
            )
            for _, ranks, _ in self.calls
        }

    @staticmethod
    def _label(ranks: tuple[int, ...] | str, **where: Any) -> str:
        return ranks if isinstance(ranks, str) else _planned.group_label(list(ranks), **where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        # modes run before tensor subclasses: let DTensor desugar into plain ops + collectives first,
        # they come back through this mode (the trick torch's CommDebugMode uses)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if isinstance(func, torch._ops.OpOverload):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)


class CommunicationLedger(Callback):
    """Records every collective of each training step: operation, mesh dim (or group), count and payload bytes.

    A step is one optimizer step: with gradient accumulation its micro-batches are added up.

    Groups are named by the pack's mesh dims when the strategy is a ``MeshStrategy`` (a group spanning
    several dims takes the most elementary name: ``dp_shard`` before ``dp``), otherwise ``world`` or their
    ranks. Per-step totals are logged (``comm/bytes``, ``comm/<op>/<dim>``); at the end of fit rank 0 prints
    a table of the mean per step next to the planner's prediction for the strategy, mesh and parameter
    shapes in use (measured / planned per op and dim).

    Args:
        skip_steps: first steps left out of the per-step mean (still logged), e.g. one-time broadcasts.
        planned: the planner's collectives to compare against; ``"auto"`` derives them from the strategy
            (DDP/replicate, ZeRO-1, FSDP2 and HSDP exactly, plus tensor-parallel block activations measured
            from the first block's input; under expert parallelism the all-to-alls from the rows each step's
            routing sent and received, :func:`lightning_dist.planner.ep_all_to_all`); None for no comparison.
        log: log per-step totals through ``pl_module.log``.
        print_table: print the rank-0 table at the end of fit.
    """

    def __init__(
        self,
        *,
        skip_steps: int = 1,
        planned: str | Sequence[planner.Collective] | None = "auto",
        log: bool = True,
        print_table: bool = True,
    ) -> None:
        if planned is not None and not isinstance(planned, str):
            planned = list(planned)
        if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 0:
            raise ValueError(f"`skip_steps={skip_steps!r}` must be an integer >= 0.")
        if not (
            planned is None
            or planned == "auto"
            or (not isinstance(planned, str) and all(isinstance(c, planner.Collective) for c in planned))
        ):
            raise ValueError(f"`planned={planned!r}` must be 'auto', None or a sequence of planner.Collective.")
        # not `self.log`: Lightning sets every callback's `log` attribute to `pl_module.log` at fit start
        self.skip_steps, self.planned_arg, self.log_figures, self.print_table = skip_steps, planned, log, print_table
        self.steps: list[dict[tuple[str, str], list[int]]] = []
        """Per optimizer step: {(op, dim): [count, payload bytes]} on this rank."""
        self.summary: list[dict[str, Any]] = []
        """Filled at the end of fit on every rank: one row per (op, dim) with measured and planned bytes."""
        self.group_sizes: dict[str, int] = {}
        """Ranks in each group label seen."""
        self.routing: list[dict[tuple[int, int, int], list[int]]] = []
        """Under expert parallelism, per optimizer step: {(experts, hidden, bytes per element): [forwards, rows sent,
        rows received]} of this rank's experts modules (the exchange the plan is computed from)."""
        self._routing_pending: dict[tuple[int, int, int], list[int]] = {}
        self._expert_hooks: list[Any] = []
        self._recorder: CollectiveRecorder | None = None
        self._pending: dict[tuple[str, str], list[int]] = {}
        self._step_at_start = 0
        self._activation: dict | None = None
        self._hook: Any = None
        self._gathered: dict[str, tuple[int, int]] = {}
        self._gather_hooks: dict[str, Any] = {}

    # ---- recording -----------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps, self.summary, self._activation, self._pending, self.group_sizes = [], [], None, {}, {}
        self.routing, self._routing_pending = [], {}
        mesh = _planned.strategy_mesh(trainer.strategy)
        if mesh is not None and (mesh.size("tp") > 1 or mesh.cp_size > 1):
            self._watch_activation(trainer, pl_module)
        if _planned.ep_degree(trainer.strategy) > 1:
            self._watch_routing(pl_module)

    def _watch_routing(self, pl_module: pl.LightningModule) -> None:
        """Count, per forward of each experts module expert parallelism split, the rows this rank sent (its tokens x
        top_k) and the rows its experts received: the all-to-alls' sizes under the routing the step had."""
        from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY

        def hook(module, args, out):
            if self._recorder is None:
                return  # a forward outside a training step
            hidden = args[0]
            state = module.__dict__[GLOBAL_EXPERTS_KEY]
            entry = self._routing_pending.setdefault(
                (state["experts"], hidden.shape[-1], hidden.element_size()), [0, 0, 0]
            )
            entry[0] += 1
            entry[1] += int(state["sent"])  # this rank's share of the tokens when the ep group spans tp
            entry[2] += int(state["arrived"])  # set by this forward's exchange of the per-expert counts

        for h in self._expert_hooks:
            h.remove()
        self._expert_hooks = [
            m.register_forward_hook(hook) for m in pl_module.modules() if GLOBAL_EXPERTS_KEY in m.__dict__
        ]

    def _watch_activation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure the block input (batch, seq, hidden, dtype) once, for the tensor- and context-parallel
        predictions (with the network and its blocks under cp, for the attention's all-to-alls)."""
        from lightning_dist.parallelize.units import find_block_lists

        lists = find_block_lists(pl_module)
        if not lists:
            return
        entries = getattr(trainer.strategy, "tp_entries", [])
        blocks = sum(len(b) for _, b in lists)
        prefixes = tuple(f"{name}." for name, _ in lists)
        rows = sum(1 for e in entries if e.active and e.style == "rowwise" and e.fqn.startswith(prefixes))
        first = lists[0][1][0]
        state = getattr(trainer.strategy, "cp_state", None)
        cp_network = None if state is None else state.network

        def hook(module, args):
            if self._recorder is None:
                return  # a forward outside a training step (the strategy's setup self-check): not the step's shapes
            x = args[0]
            seq = x.shape[1] if x.dim() == 3 else 1
            self._activation = {
                "batch": x.shape[0],
                "seq": seq,
                "hidden": x.shape[-1],
                "bytes": x.element_size(),
                "blocks": blocks,
                "row_parallel_per_block": max(1, rows // blocks),
                "cp_network": cp_network,
                "block_lists": lists,
            }
            self._hook.remove()

        self._hook = first.register_forward_pre_hook(hook)
        # layers whose split output is gathered back (`colwise_gather`, e.g. an output head): their forward
        # all-gather of the output and backward all-reduce of the input gradient, measured on their tensors
        modules = dict(pl_module.named_modules())
        self._gathered = {}
        for e in entries:
            if e.active and e.style == "colwise_gather" and e.fqn in modules:

                def gather_hook(module, args, out, fqn=e.fqn):
                    if (
                        self._recorder is not None
                        and isinstance(args[0], torch.Tensor)
                        and isinstance(out, torch.Tensor)
                    ):
                        self._gathered[fqn] = (
                            args[0].numel() * args[0].element_size(),
                            out.numel() * out.element_size(),
                        )
                        self._gather_hooks.pop(fqn).remove()

                self._gather_hooks[e.fqn] = modules[e.fqn].register_forward_hook(gather_hook)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step
        self._recorder = CollectiveRecorder(outside=_planned.outside_dim(trainer.strategy))
        self._recorder.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._recorder is None:
            return
        rec, self._recorder = self._recorder, None
        rec.__exit__(None, None, None)
        mesh, rank, world = self._where(trainer)
        ep = _planned.ep_degree(trainer.strategy)
        self.group_sizes.update(rec.group_sizes(mesh=mesh, rank=rank, world=world, ep=ep))
        for key, (count, nbytes) in rec.totals(mesh=mesh, rank=rank, world=world, ep=ep).items():
            entry = self._pending.setdefault(key, [0, 0])
            entry[0] += count
            entry[1] += nbytes
        if trainer.global_step == self._step_at_start:
            return  # gradient accumulation: the optimizer step (and the ledger's step) is not over yet
        step, self._pending = self._pending, {}
        self.steps.append(step)
        self.routing.append(self._routing_pending)
        self._routing_pending = {}
        if self.log_figures:
            pl_module.log("comm/bytes", float(sum(v[1] for v in step.values())), on_step=True, on_epoch=False)
            for (op, dim), (_, nbytes) in step.items():
                pl_module.log(f"comm/{op}/{dim}", float(nbytes), on_step=True, on_epoch=False)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._recorder is not None:  # never leave the mode on the dispatch stack
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    @staticmethod
    def _where(trainer: pl.Trainer) -> tuple[Any, int, int]:
        initialized = dist.is_available() and dist.is_initialized()
        return (
            _planned.strategy_mesh(trainer.strategy),
            dist.get_rank() if initialized else 0,
            dist.get_world_size() if initialized else 1,
        )

    # ---- summary -------------------------------------------------------------------------------
    def per_step(self) -> dict[tuple[str, str], tuple[float, float]]:
        """Mean (count, payload bytes) per step for each (op, dim), after the first ``skip_steps`` steps."""
        steps = self.steps[self.skip_steps :] or self.steps
        out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        for step in steps:
            for key, (count, nbytes) in step.items():
                out[key][0] += count / len(steps)
                out[key][1] += nbytes / len(steps)
        return {k: (v[0], v[1]) for k, v in out.items()}

    def routing_per_step(self) -> list[dict[str, Any]]:
        """Mean per step (the steps of :meth:`per_step`) of :attr:`routing`, one entry per kind of experts module:
        ``{"experts", "hidden", "bytes", "calls", "rows", "received"}`` (what ``planned_traffic`` takes)."""
        steps = self.routing[self.skip_steps :] or self.routing
        out: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for step in steps:
            for key, values in step.items():
                for i, v in enumerate(values):
                    out[key][i] += v / len(steps)
        return [
            {"experts": e, "hidden": h, "bytes": b, "calls": c, "rows": rows, "received": recv}
            for (e, h, b), (c, rows, recv) in out.items()
        ]

    def _planned_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[tuple[str, str], float] | None:
        if self.planned_arg is None:
            return None
        if self.planned_arg == "auto":
            activation = (
                None if self._activation is None else {**self._activation, "gathered": list(self._gathered.values())}
            )
            collectives = _planned.planned_traffic(
                trainer, pl_module, activation=activation, routing=self.routing_per_step() or None
            )
            if collectives is None:
                return None
            collectives = [*collectives, *_diloco_sync(trainer.strategy, pl_module)]
        else:
            collectives = list(self.planned_arg)
        mesh, rank, world = self._where(trainer)
        ep = _planned.ep_degree(trainer.strategy)
        out: dict[tuple[str, str], float] = defaultdict(float)
        for c in collectives:
            # the recorder counts each side of a point-to-point transfer; a send_recv's payload is what one rank
            # sends, and it receives as many bytes (activations in, their gradients back)
            for op in ("send", "recv") if c.op == "send_recv" else (c.op,):
                out[(op, _planned.dim_label(c.dim, mesh=mesh, rank=rank, world=world, ep=ep))] += c.payload_bytes
        return dict(out)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
        for h in self._expert_hooks:
            h.remove()
        self._expert_hooks = []
        measured = self.per_step()
        planned = self._planned_rows(trainer, pl_module) or {}
        keys = sorted(set(measured) | set(planned))
        _, rank, world = self._where(trainer)
        self.summary = []
        for op, dim in keys:
            count, got = measured.get((op, dim), (0.0, 0.0))
            want = planned.get((op, dim))
            group_size = self.group_sizes.get(dim, world)
            wire = (
                planner.Collective(op=op, dim=dim, group_size=group_size, payload_bytes=got).wire_bytes
                if op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
                else got
            )
            self.summary.append(
                {
                    "op": op,
                    "dim": dim,
                    "count": count,
                    "bytes": got,
                    "wire_bytes": wire,
                    "planned_bytes": want,
                    "ratio": (got / want) if want else None,
                }
            )
        if self.print_table:
            rows = _gather(self.summary)
            if rank == 0:
                print(
                    format_ledger(
                        rows,
                        title=f"Communication per step ({type(trainer.strategy).__name__},"
                        f" mean of {len(self.steps[self.skip_steps :] or self.steps)}"
                        " steps, payload bytes)",
                    ),
                    flush=True,
                )


def _gather(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    if dist.is_available() and dist.is_initialized():
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, rows)
        return out
    return [rows]


def _diloco_sync(strategy: Any, module: torch.nn.Module) -> list[planner.Collective]:
    """Under ``FaultTolerance(sync="diloco")``: the planner's row of DiLoCo's all-reduce across the replica groups
    (``planner.diloco_sync_traffic``: every parameter's local shard, as DiLoCo sends it, once per ``sync_every``
    steps, per step averaged), on the strategy's dim for torchft's process group; else none."""
    config = getattr(strategy, "fault_tolerance", None)
    if config is None or not getattr(config, "diloco", False):
        return []
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    numel = sum(t.numel() for t in local)
    if not numel:
        return []
    return [
        planner.diloco_sync_traffic(
            numel,
            param_bytes=sum(t.numel() * t.element_size() for t in local) / numel,
            inner_steps=config.inner_steps,
            replica_groups=strategy.replica_groups,
            dim=_planned.outside_dim(strategy),
        )
    ]


def format_ledger(per_rank: list[list[dict[str, Any]]], *, title: str = "Communication per step") -> str:
    """Rich table: rows (rank, op, dim) with count, payload and wire bytes, planned payload, measured / planned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("rank", "op", "dim", "calls", "payload B", "wire B", "planned B", "measured/planned"):
        table.add_column(col, justify="left" if col in ("op", "dim") else "right")
    for rank, rows in enumerate(per_rank):
        for r in rows:
            table.add_row(
                str(rank),
                r["op"],
                r["dim"],
                f"{r['count']:.1f}",
                f"{r['bytes']:,.0f}",
                f"{r['wire_bytes']:,.0f}",
                "-" if r["planned_bytes"] is None else f"{r['planned_bytes']:,.0f}",
                "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
            )
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(table)
    return buf.getvalue()
