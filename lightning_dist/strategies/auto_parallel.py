"""AutoParallelStrategy: the least parallelism that fits the device memory, chosen at setup
(``strategy="auto_parallel"``).

Notes: docs/internals.md, "lightning_dist/strategies/auto_parallel.py"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dist import inputs, planner, rules
from lightning_dist._integrations.lightning import hand_over_strategy
from lightning_dist.mesh import CP, DP_REPLICATE, DP_SHARD, PP, TP
from lightning_dist.parallelize.counts import count_params
from lightning_dist.precision import precision_flag
from lightning_dist.strategies.base import MeshStrategy


def strategy_for(layout: planner.Layout) -> tuple[type, dict[str, Any]]:
    """(strategy class, keyword arguments) that run `layout` (a kind of :data:`planner.AUTO_KINDS`)."""
    from lightning_dist.strategies.hsdp import FullyShardStrategy, HybridShardStrategy
    from lightning_dist.strategies.pipeline.strategy import PipelineStrategy
    from lightning_dist.strategies.tp import TensorParallelStrategy

    m = layout.mesh
    if layout.kind in ("ddp", "hsdp"):
        return HybridShardStrategy, {"shard_size": m[DP_SHARD], "dp_replicate": m[DP_REPLICATE]}
    if layout.kind == "fsdp":
        return FullyShardStrategy, {}
    if layout.kind == "tp":
        return TensorParallelStrategy, {"tp": m[TP], "dp_replicate": m[DP_REPLICATE], "dp_shard": m[DP_SHARD]}
    if layout.kind == "cp":
        return HybridShardStrategy, {
            "cp": m[CP],
            "cp_style": layout.cp_style,
            "dp_replicate": m[DP_REPLICATE],
            "shard_size": m[DP_SHARD],
        }
    if layout.kind == "pp":
        return PipelineStrategy, {"pp": m[PP], "dp_replicate": m[DP_REPLICATE], "dp_shard": m[DP_SHARD]}
    if layout.kind == "offload":  # FSDP2OffloadStrategy's policy; its report mixin cannot be swapped into
        from lightning_dist._compat import CUDA_AVAILABLE, fully_shard_api

        return HybridShardStrategy, {
            "shard_size": "full",
            "offload_policy": fully_shard_api()[2](pin_memory=CUDA_AVAILABLE),
        }
    raise ValueError(f"auto_parallel does not run layouts of kind {layout.kind!r}; kinds: {planner.AUTO_KINDS}.")


class AutoParallelStrategy(MeshStrategy):
    """Pick the least parallelism that fits ``device_memory``, then run as that strategy.

    Args:
        device_memory: bytes per device (a number, or text such as ``"80GB"`` / ``"24GiB"``); None: the total
            memory of the CUDA device (``strategy="auto_parallel"``); required on CPU.
        prefer: layout kinds to try first, in order (``"ddp"``, ``"hsdp"``, ``"fsdp"``, ``"tp"``, ``"cp"``, ``"pp"``,
            ``"offload"``); otherwise least parallelism first.
        verify: also dry-run (fake process group, fake tensors) the candidates in order until one fits (at
            most 4 dry runs, on rank 0) and skip those whose measured model states + peak activations do not. Needs the
            LightningModule's init
            arguments in ``hparams`` (``save_hyperparameters()``) and a batch it can build (see ``dryrun``).
        global_batch: samples per optimizer step over all ranks; layouts whose data-parallel size does not
            divide it are skipped (each data-parallel rank needs the same whole number of samples).
        optimizer: optimizer the planner sizes the state for (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-momentum"``).
        batch_size, seq_len: per data-parallel rank, for ``verify``'s dry run (default 8 samples, block size). With
            ``seq_len`` (and a network whose attention is known: the pack's GPT, HF models) the candidates include
            context-parallel layouts (``cp x dp``: activations / cp), and tp / pp traffic counts activations.
        activation_checkpointing, selective_ac_ops, offload_activations: given to whichever strategy is chosen
            (every choice takes them; see :mod:`lightning_dist.parallelize.ac`), checked here first.
        options: extra keyword arguments per chosen strategy class name, e.g.
            ``{"PipelineStrategy": {"n_microbatches": 4}, "TensorParallelStrategy": {"tp_plan": "auto"}}``.
        **kwargs: :class:`MeshStrategy` options every choice takes (``timeout``, ``process_group_backend``...).
    """

    strategy_name = "auto_parallel"

    def __init__(
        self,
        *,
        device_memory: Union[int, float, str, None] = None,
        prefer: Union[str, Sequence[str]] = (),
        verify: bool = False,
        global_batch: Optional[int] = None,
        optimizer: str = "adamw",
        batch_size: int = 8,
        seq_len: Optional[int] = None,
        options: Optional[Mapping[str, Mapping[str, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        problems = []
        memory: Optional[int] = None
        if device_memory is not None:
            try:
                memory = inputs.parse_bytes(device_memory)
            except ValueError as err:
                problems.append(str(err))
        prefer = (prefer,) if isinstance(prefer, str) else tuple(prefer)
        bad = [p for p in prefer if p not in planner.AUTO_KINDS]
        if bad:
            problems.append(f"`prefer={list(prefer)!r}`: {bad} are not layout kinds; use some of {planner.AUTO_KINDS}.")
        if not isinstance(verify, bool):
            problems.append(f"`verify={verify!r}` must be True or False.")
        if global_batch is not None and (
            isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1
        ):
            problems.append(f"`global_batch={global_batch!r}` must be an integer >= 1.")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if (value is not None or name == "batch_size") and not _positive_int(value):
                problems.append(f"`{name}={value!r}` must be an integer >= 1{_SIZES[name]}.")
        if optimizer not in planner.OPTIMIZER_SLOTS:
            problems.append(f"`optimizer={optimizer!r}` must be one of {sorted(planner.OPTIMIZER_SLOTS)}.")
        self._defer_problems(problems)  # raised by MeshStrategy with the model options' problems
        super().__init__(**kwargs)
        self.device_memory, self.prefer, self.verify = memory, prefer, verify
        self.global_batch, self.optimizer, self.batch_size, self.seq_len = global_batch, optimizer, batch_size, seq_len
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        self._common = dict(kwargs)  # the mesh, model and checkpoint options, given to the chosen strategy
        self.choice: Optional[planner.Layout] = None
        """The chosen layout (set in ``setup_environment``)."""

    # ---- choosing ------------------------------------------------------------------------------
    def candidates(self) -> list[planner.Layout]:
        """The planner's fitting, runnable layouts for the attached model, best first (pure arithmetic)."""
        return planner.rank_layouts(self._layouts(), global_batch=self.global_batch, prefer=self.prefer)

    def _layouts(self, *, fitted: bool = True) -> list[planner.Layout]:
        """Every candidate layout, with ``fits`` judged by :func:`device_need` (`fitted=False`: not judged)."""
        assert self.lightning_module is not None
        state = planner.state_bytes(precision=precision_flag(self.precision_plugin), optimizer=self.optimizer)
        counts = count_params(self.lightning_module)
        layouts = planner.candidate_layouts(
            counts,
            world_size=self.num_nodes * self.num_processes,
            devices_per_node=self.num_processes,
            state=state,
            activation=self._activation(state),
        )
        memory = self.device_memory if fitted else None
        return [
            replace(layout, fits=None if memory is None else device_need(layout, counts, state) <= memory)
            for layout in layouts
        ]

    def _activation(self, state: planner.StateBytes) -> Optional[planner.ActivationShape]:
        """The step's activation shape when ``seq_len`` is given and the network's attention is known (the pack's
        GPT, HF models): it adds the context-parallel layouts and the tp / pp activation traffic."""
        from lightning_dist.parallelize.cp import attention_shape

        network = getattr(self.lightning_module, "model", None)
        shape = attention_shape(network) if isinstance(network, torch.nn.Module) else None
        if not self.seq_len or self.seq_len < 2 or shape is None:
            return None
        heads, _, head_dim = shape
        return planner.ActivationShape(
            batch=self.batch_size,
            seq=self.seq_len,
            hidden=heads * head_dim,
            bytes_per_element=state.gather,
            heads=heads,
        )

    def _verified(self, ranked: list[planner.Layout], *, max_runs: int = 4) -> list[planner.Layout]:
        """Dry-run the candidates in order until one fits (at most `max_runs` dry runs; rank 0 only); drop
        those that do not. Offload layouts keep nothing on the device and are not dry-run."""
        from lightning_dist.dryrun import DryRunConfig, dry_run

        module = self.lightning_module
        cls = type(module)
        kept, runs, found = [], 0, False
        for layout in ranked:
            # offload keeps nothing on the device; replicated layouts hold the whole model per rank (the planner's
            # figure is exact) and the dry run cannot replay torch's DDP reducer: neither is dry-run
            replicated = layout.kind != "pp" and rules.replicates(
                zero_stage=layout.zero_stage, dp_shard=layout.mesh[DP_SHARD], tp=layout.mesh[TP], cp=layout.mesh[CP]
            )
            if found or layout.kind == "offload" or replicated or runs >= max_runs:
                kept.append(layout)
                found = found or replicated
                continue
            strategy_cls, kwargs = strategy_for(layout)
            runs += 1
            report = dry_run(
                DryRunConfig(
                    # hparams without LightningCLI's private entries (`_instantiator`, `_class_path`)
                    model=f"{cls.__module__}.{cls.__qualname__}",
                    init_args={k: v for k, v in module.hparams.items() if not k.startswith("_")},
                    # activations as the run will keep them (offload_activations needs CUDA, which the dry run is not)
                    strategy=f"{strategy_cls.__module__}.{strategy_cls.__qualname__}",
                    strategy_args={
                        **kwargs,
                        "activation_checkpointing": self.activation_checkpointing,
                        "selective_ac_ops": self.selective_ac_ops,
                    },
                    world_size=self.num_nodes * self.num_processes,
                    devices_per_node=self.num_processes,
                    precision=str(self.precision_plugin.precision),
                    batch_size=self.batch_size,
                    seq_len=self.seq_len,
                    device_memory=self.device_memory,
                )
            )
            if all(report.fits(r) for r in report.ranks):
                kept.append(layout)
                found = True
            else:
                rank_zero_info(f"auto_parallel: {layout.name} does not fit in the dry run:\n{report.format()}")
        return kept

    @override
    def setup_environment(self) -> None:
        # the world process group first (to agree on one choice), then hand the run to the chosen strategy
        if self.device_memory is None:
            if self.root_device.type != "cuda":
                raise ValueError(
                    "auto_parallel needs device_memory=... (e.g. '80GB') on a non-CUDA device: it picks"
                    " the least parallelism that fits that memory."
                )
            import torch

            self.device_memory = torch.cuda.get_device_properties(self.root_device).total_memory
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        ranked: list[planner.Layout] = []
        if self.global_rank == 0:
            ranked = self.candidates()
            if self.verify:
                ranked = self._verified(ranked)
        names = self.broadcast([layout.name for layout in ranked[:2]])
        if not names:
            raise ValueError(self._nothing_fits())
        ranked = ranked or [layout for name in names for layout in self.candidates() if layout.name == name]
        self.choice = ranked[0]
        rank_zero_info(format_choice(ranked[:2], device_memory=self.device_memory))
        assert self.lightning_module is not None
        chosen = self.build(self.choice)
        hand_over_strategy(self.lightning_module.trainer, self, chosen)
        chosen.setup_environment()

    def _nothing_fits(self) -> str:
        """The refusal when no layout fits, naming the smallest need (the same on every rank: pure arithmetic)."""
        state = planner.state_bytes(precision=precision_flag(self.precision_plugin), optimizer=self.optimizer)
        counts = count_params(self.lightning_module)
        runnable = planner.rank_layouts(self._layouts(fitted=False), global_batch=self.global_batch)
        smallest = min(runnable, key=lambda layout: device_need(layout, counts, state), default=None)
        if smallest is None:
            need = f" No layout's data-parallel size divides global_batch={self.global_batch}: change global_batch."
        else:
            what = " (the largest FSDP unit gathered, with its gradient)" if smallest.kind == "offload" else ""
            need = (
                f" The smallest layout, {smallest.name}, needs {device_need(smallest, counts, state):,.0f} bytes per"
                f" device{what}: give at least that much device_memory, or use more devices or a smaller model."
            )
        return (
            f"auto_parallel: no layout fits device_memory={self.device_memory or 0:,} bytes"
            f"{f' with global_batch={self.global_batch}' if self.global_batch else ''} on"
            f" {self.num_nodes * self.num_processes} devices, not even with everything offloaded to host memory.{need}"
            " `lightning-dist plan` shows what each layout needs."
        )

    def build(self, layout: planner.Layout) -> MeshStrategy:
        """The strategy that runs `layout`, built from this strategy's options (the MeshStrategy options, the
        activation options and ``options[<class name>]``); its ``choice`` is `layout`. This object is unchanged."""
        cls, kwargs = strategy_for(layout)
        strategy = cls(**{**self._common, **kwargs, **self.options.get(cls.__name__, {})})
        strategy.choice = layout  # type: ignore[attr-defined]
        return strategy

    def __repr__(self) -> str:
        return (
            f"AutoParallelStrategy(device_memory={self.device_memory}, prefer={list(self.prefer)},"
            f" verify={self.verify})"
        )


_SIZES = {
    "batch_size": " (samples per data-parallel rank for the dry run)",
    "seq_len": " (tokens per sequence, e.g. 8192 rather than '8k'), or None",
}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def device_need(layout: planner.Layout, counts: planner.ParamCounts, state: planner.StateBytes) -> float:
    """The device bytes `layout` needs at least: its model states on the device, and for an offload layout (model
    states in host memory, 0 bytes on the device in the planner's column) the largest FSDP unit, which FSDP2 copies to
    the device and gathers for its forward and backward and whose gradient it reduces there before moving it back."""
    if layout.offload.params == "device":
        return layout.memory.total
    # FSDP units: each block of the block list, and the root holding the rest (embeddings, head); one unit: all
    unit = max((*counts.layer_params, counts.pre_params + counts.post_params)) if counts.layer_params else counts.total
    return layout.memory.total + unit * (state.gather + state.reduce)


def format_choice(ranked: Sequence[planner.Layout], *, device_memory: float) -> str:
    """The choice and the runner-up with their memory and traffic (a rich table, as text)."""
    import io

    from rich.console import Console
    from rich.table import Table

    from lightning_dist.dryrun_report import format_bytes

    table = Table(title=f"auto_parallel: least parallelism that fits {format_bytes(device_memory)} per device")
    for col in (
        "",
        "layout",
        "strategy",
        "mesh pp x dp_rep x dp_shard x tp",
        "device bytes",
        "host bytes",
        "traffic/step",
    ):
        table.add_column(col, justify="left" if col in ("", "layout", "strategy") else "right", no_wrap=True)
    for label, layout in zip(("choice", "runner-up"), ranked):
        cls, _ = strategy_for(layout)
        m = layout.memory
        table.add_row(
            label,
            layout.name,
            cls.__name__,
            " x ".join(str(v) for v in layout.mesh.values()),
            format_bytes(m.total),
            format_bytes(m.host + m.nvme),
            format_bytes(layout.wire_bytes),
        )
    buf = io.StringIO()
    Console(file=buf, width=130, force_terminal=False).print(table)
    return buf.getvalue()


__all__ = ["AutoParallelStrategy", "device_need", "format_choice", "strategy_for"]
