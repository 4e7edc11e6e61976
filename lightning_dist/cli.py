"""The ``lightning-dist`` command.

Notes: docs/internals.md, "lightning_dist/cli.py"."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

# decimal units, as DeepSpeed's ZeRO tutorial uses (1 GB = 1e9 bytes)
_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B"))


def _unit(largest: float) -> tuple[float, str]:
    """The largest decimal unit in which ``largest`` is at least 1 (so small models do not print 0.000)."""
    return next(((scale, name) for scale, name in _UNITS if largest >= scale), _UNITS[-1])


# ---- plan -------------------------------------------------------------------------------------------------
def _add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from lightning_dist.planner import OPTIMIZER_SLOTS, PRECISIONS, SCHEDULES

    p = sub.add_parser(
        "plan",
        help="memory and traffic per device of each parallel layout; recommends the least parallelism that fits",
        description="Plan a distributed run: model-state memory per device (params / grads / optimizer state) and"
        " communication per step for DDP, ZeRO 1/2/3, hybrid sharding, tensor and pipeline parallel and"
        " offloading. The model is built on the meta device (no memory). Decimal units: 1 GB = 1e9 bytes.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        metavar="CLASS_PATH",
        help="a torch.nn.Module / LightningModule class: dotted path"
        " (my_pkg.models.GPT; the working folder is searched too) or a file with it (./my_model.py:Net)",
    )
    src.add_argument("--config", metavar="YAML", help="LightningCLI config with model.class_path / model.init_args")
    src.add_argument("--params", metavar="N", help="parameter count instead of a model, e.g. 1.5e9, 1.5B, 125M")
    src.add_argument(
        "--hf-config", metavar="JSON", help="a transformers config.json (or its folder): the causal LM it describes"
    )
    p.add_argument("--init-args", metavar="JSON", default=None, help="keyword arguments of --model as a JSON object")
    p.add_argument("--world-size", type=int, required=True, help="number of processes (devices)")
    p.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default: the world size)")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (1e9 B), 24GiB (2**30 B), bytes")
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        choices=sorted(PRECISIONS),
        metavar="PRECISION",
        help=f"Lightning precision flag (default bf16-mixed): {', '.join(sorted(PRECISIONS))}",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZER_SLOTS),
        metavar="OPTIMIZER",
        help=f"optimizer (default adamw): {', '.join(sorted(OPTIMIZER_SLOTS))}",
    )
    p.add_argument(
        "--master-weights",
        action="store_true",
        help="ZeRO/DeepSpeed convention: 16-bit params and grads + fp32 master copy (Adam: 2 + 2 + 12)",
    )
    p.add_argument(
        "--optimizer-state-bytes",
        type=float,
        default=None,
        help="optimizer-state bytes per parameter, overriding --optimizer's",
    )
    p.add_argument("--micro-batches", type=int, default=8, help="pipeline micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES[:2], help="pipeline schedule (default 1f1b)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per data-parallel rank per step (activations)")
    p.add_argument("--seq-len", type=int, default=1, help="sequence length (activations, default 1)")
    p.add_argument("--hidden-size", type=int, default=None, help="hidden size between blocks (activations)")
    p.add_argument(
        "--heads",
        type=int,
        default=None,
        help="attention heads: context-parallel layouts (listed for --seq-len > 1) need cp to divide them",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="transformer blocks (activations; with --params, --model/--config count them)",
    )
    p.add_argument("--mlp-hidden", type=int, default=None, help="MLP inner width (activations; default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size: the output head's activations")
    p.add_argument(
        "--activation-checkpointing",
        default="none",
        metavar="MODE",
        help="activations kept per block: none (default), full, selective or every:N",
    )
    moe = p.add_argument_group(
        "mixtures of experts",
        "expert-parallel (ep) layouts: read off a model's experts modules and config, or given here (these override)",
    )
    moe.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer")
    moe.add_argument("--top-k", type=int, default=None, help="experts each token is routed to")
    moe.add_argument(
        "--expert-params",
        metavar="N",
        default=None,
        help="routed-expert parameters of all layers (with --params; the MoE layers are --layers)",
    )
    p.add_argument(
        "--replica-groups",
        type=int,
        default=None,
        metavar="N",
        help="fault_tolerance=: the dp_replicate replicas are N torchft replica groups; lists the layouts with"
        " dp_replicate=N (states and traffic as plain, the all-reduce across the groups torchft's) and the heal"
        " column: what one rank sends to the matching rank of a healing group",
    )
    p.add_argument(
        "--sync",
        choices=("step", "diloco"),
        default=None,
        help="with --replica-groups: how the groups average (FaultTolerance(sync=)): step (default), the gradients"
        " every step; diloco, the pseudo-gradients once every --sync-every steps",
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        metavar="H",
        help="with --sync diloco (required there): DiLoCo's inner steps between two syncs"
        " (FaultTolerance(sync_every=))",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="save a stacked bar chart of memory per device")
    return p


def _plan_counts(args: argparse.Namespace):
    """(parameter counts, label, :class:`~lightning_dist.planner.MoEShape` or None) of the model to plan."""
    from lightning_dist import inputs, planner

    if args.params is not None:
        if args.init_args is not None:
            raise ValueError("--init-args goes with --model; --params takes a plain count.")
        counts = planner.ParamCounts(total=inputs.parse_count(args.params))
        return counts, f"{args.params} parameters", _given_moe(args)
    if args.expert_params is not None:
        raise ValueError("--expert-params goes with --params; a model's expert parameters are counted from it.")
    if args.config is not None:
        if args.init_args is not None:
            raise ValueError("--init-args goes with --model; with --config the init args come from the YAML.")
        class_path, init_args = inputs.model_spec_from_config(args.config)
        model = inputs.build_meta_model(class_path, init_args)
    elif args.hf_config is not None:
        if args.init_args is not None:
            raise ValueError("--init-args goes with --model; --hf-config describes the model itself.")
        class_path, model = args.hf_config, inputs.build_meta_hf_model(args.hf_config)
    else:
        class_path, init_args = args.model, args.init_args
        model = inputs.build_meta_model(class_path, init_args)
    from lightning_dist.parallelize.counts import count_params  # the runtime's split of the model

    spec = inputs.moe_spec(model, experts=args.experts, top_k=args.top_k)
    if spec is None and (args.experts is not None or args.top_k is not None):
        raise ValueError(f"--experts / --top-k given, but {class_path} has no experts module to plan them for.")
    return count_params(model), class_path, planner.MoEShape(**spec) if spec is not None else None


def _given_moe(args: argparse.Namespace):
    """The :class:`~lightning_dist.planner.MoEShape` of ``--params`` with ``--experts`` (None without)."""
    from lightning_dist import inputs, planner

    given = {"--experts": args.experts, "--top-k": args.top_k, "--expert-params": args.expert_params}
    if all(v is None for v in given.values()):
        return None
    given.update({"--hidden-size": args.hidden_size, "--layers": args.layers})
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"With --params, a mixture of experts needs {', '.join(missing)} too (--layers: MoE layers).")
    return planner.MoEShape(
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden_size,
        layers=args.layers,
        expert_params=inputs.parse_count(args.expert_params),
    )


def _plan_sync(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """(sync mode, DiLoCo inner steps) of ``--sync`` / ``--sync-every``: (None, None) without ``--replica-groups``."""
    if args.replica_groups is None:
        flags = (("--sync", args.sync), ("--sync-every", args.sync_every))
        given = [f"{flag} {value}" for flag, value in flags if value is not None]
        if given:
            raise ValueError(
                f"{' '.join(given)} plans how fault-tolerant replica groups sync: add --replica-groups N"
                " (the torchft replica groups), or drop it."
            )
        return None, None
    sync = args.sync or "step"
    if sync == "step":
        if args.sync_every is not None:
            raise ValueError(
                f"--sync-every {args.sync_every} is DiLoCo's inner steps: add --sync diloco, or drop --sync-every"
                " (--sync step all-reduces the gradients every step)."
            )
        return sync, None
    if args.sync_every is None:
        raise ValueError("--sync diloco needs --sync-every H (DiLoCo's inner steps between two syncs), e.g. 100.")
    if args.sync_every < 1:
        raise ValueError(f"--sync-every {args.sync_every}: DiLoCo syncs once every H >= 1 steps; pass H >= 1.")
    return sync, args.sync_every


def run_plan(args: argparse.Namespace) -> int:
    from lightning_dist import inputs, planner

    sync, sync_every = _plan_sync(args)
    state = planner.state_bytes(
        precision=args.precision,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        optimizer_state_bytes=args.optimizer_state_bytes,
    )
    device_memory = inputs.parse_bytes(args.device_memory) if args.device_memory is not None else None
    activation = _activation_shape(args, state)
    counts, label, moe = _plan_counts(args)
    layouts = planner.candidate_layouts(
        counts,
        world_size=args.world_size,
        devices_per_node=args.devices_per_node or args.world_size,
        state=state,
        device_memory=device_memory,
        activation=activation,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
    )
    layouts = planner.count_activations(
        layouts,
        counts,
        activation=activation,
        state=state,
        device_memory=device_memory,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
    )
    if args.replica_groups is not None:
        if args.world_size % args.replica_groups:
            raise ValueError(
                f"--replica-groups {args.replica_groups} does not divide --world-size {args.world_size}: every"
                " replica group has the same number of ranks."
            )
        layouts = planner.fault_tolerant_layouts(
            layouts, replica_groups=args.replica_groups, counts=counts, state=state, sync=sync, inner_steps=sync_every
        )
    best = planner.recommend(layouts)
    ep = None
    if moe is not None:
        ep = planner.ep_layouts(
            counts.total,
            moe,
            world_size=args.world_size,
            state=state,
            tokens=args.batch_size * args.seq_len if args.batch_size is not None else None,
            bytes_per_element=state.gather,
            device_memory=device_memory,
            tp_sharded_params=counts.tp_sharded_params,
            devices_per_node=args.devices_per_node,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "model": label,
                    "params": counts.total,
                    "tp_sharded_params": counts.tp_sharded_params,
                    "world_size": args.world_size,
                    "replica_groups": args.replica_groups,
                    "sync": sync,
                    "sync_every": sync_every,
                    "devices_per_node": args.devices_per_node or args.world_size,
                    "device_memory": device_memory,
                    "state_bytes": dataclasses.asdict(state),
                    "layouts": [layout.to_dict() for layout in layouts],
                    "recommended": best.name if best else None,
                    "recommendation": _recommendation(best, args),
                    **(
                        {}
                        if moe is None
                        else {
                            "moe": dataclasses.asdict(moe),
                            "routing": planner.UNIFORM_ROUTING,
                            "ep_layouts": [layout.to_dict() for layout in ep or ()],
                        }
                    ),
                },
                indent=2,
            )
        )
    else:
        _print_plan(layouts, best, label=label, counts=counts, state=state, device_memory=device_memory, args=args)
        if moe is not None:
            _print_ep(ep or [], moe, state=state, device_memory=device_memory, args=args)
    if args.plot:
        _plot_plan(layouts, best, path=args.plot, device_memory=device_memory, title=label)
        if not args.json:
            print(f"Saved the memory chart to {args.plot}")
    return 0


def _activation_shape(args: argparse.Namespace, state: Any):
    """The activation shape of ``--batch-size``, ``--seq-len``, ``--hidden-size`` and the block options; None
    without a batch size and hidden size."""
    from lightning_dist import planner

    if (args.batch_size is None) != (args.hidden_size is None):
        raise ValueError(
            "Give --batch-size and --hidden-size together to count activations"
            f" (got batch_size={args.batch_size}, hidden_size={args.hidden_size})."
        )
    if args.batch_size is None:
        return None
    checkpointed = {"none": False, "full": True}.get(args.activation_checkpointing, args.activation_checkpointing)
    return planner.ActivationShape(
        batch=args.batch_size,
        seq=args.seq_len,
        hidden=args.hidden_size,
        bytes_per_element=state.gather,
        heads=args.heads,
        blocks=args.layers,
        mlp_hidden=args.mlp_hidden,
        vocab=args.vocab,
        checkpointed=checkpointed,
    )


# the planner's reasons for a row without activations that the command's options answer
_ROW_REASONS = {"no activation shape": "no shape", "blocks unknown": "needs --layers"}


def _missing_flags(args: argparse.Namespace) -> str:
    """The options that would let the plan count activations, in words."""
    if args.batch_size is None:
        layers = " and --layers" if args.params is not None and args.layers is None else ""
        return f"give --batch-size, --seq-len, --hidden-size{layers}"
    return "give --layers (the number of blocks)"


def _recommendation(best, args: argparse.Namespace) -> str:
    """The recommendation line: the layout, and whether its activations were counted (and if not, how to)."""
    if best is None:
        return "No layout fits the device memory."
    if best.activations is not None:
        counted = "model states + activations fit"
    elif best.activations_missing in _ROW_REASONS:
        counted = f"model states fit; activations NOT counted: {_missing_flags(args)}"
    else:
        counted = f"model states fit; activations NOT counted: {best.activations_missing}"
    return f"Recommended (least parallelism whose {counted}): {best.name} - {best.note}"


def _print_plan(layouts, best, *, label, counts, state, device_memory, args) -> None:
    from rich.console import Console
    from rich.table import Table

    scale, unit = _unit(
        max(
            max(lay.memory.total + (lay.activations or 0) + lay.memory.host + lay.memory.nvme for lay in layouts),
            device_memory or 0,
        )
    )
    mem = f", device memory {device_memory / scale:.3g} {unit}" if device_memory else ""
    table = Table(
        title=f"{label}: {counts.total:,} params, {state.param:g} + {state.grad:g} + {state.optimizer:g}"
        f" bytes/param{mem}; memory and traffic in {unit}",
        caption=f"{unit} per device (1 kB = 1e3 B). act: peak activations (why not, where they cannot be"
        " counted); device: model states + act. traffic: what one device sends per step (ring collectives;"
        " +act: without the activations' share). mesh: pp x dp_replicate x dp_shard x cp x tp; a cp layout"
        " holds 1/cp of each sequence per device. * = recommended."
        + (
            f" {args.replica_groups} fault-tolerant replica groups (dp_replicate, torchft): the all-reduce across them"
            " is torchft's"
            + (
                f" (--sync diloco: DiLoCo's all-reduce of this rank's pseudo-gradients once every {args.sync_every}"
                f" steps instead of the gradients' every step; traffic counts its mean per step, 1/{args.sync_every}"
                " of a sync)"
                if args.sync == "diloco"
                else " (--sync step: the gradients, every step)"
            )
            + "; heal: what one rank sends to the matching rank of a healing group, once per heal"
            " (model and optimizer shards, a pipeline rank its stage's; loop and RNG state, a few kB, not counted)."
            if args.replica_groups
            else ""
        ),
    )
    heal = args.replica_groups is not None
    cols = ("layout", "mesh", "params", "grads", "optim", "act", "device", "host", "traffic", "idle", "fits")
    for col in cols[:-1] + (("heal",) if heal else ()) + cols[-1:]:
        table.add_column(col, justify="left" if col in ("layout", "mesh") else "right", no_wrap=col != "act")
    for lay in layouts:
        m = lay.memory
        mark = " *" if best is not None and lay.name == best.name else ""
        traffic = f"{lay.wire_bytes / scale:.3g}" + ("" if lay.activations_counted else " +act")
        missing = _ROW_REASONS.get(lay.activations_missing, lay.activations_missing)
        act = missing if lay.activations is None else f"{lay.activations / scale:.3g}"
        fits = "-" if lay.fits is None else ("yes" if lay.fits else "no")
        table.add_row(
            lay.name + mark,
            "x".join(str(v) for v in lay.mesh.values()),
            *(f"{v / scale:.3g}" for v in (m.params, m.grads, m.optimizer)),
            act,
            f"{(m.total + (lay.activations or 0)) / scale:.3g}",
            f"{(m.host + m.nvme) / scale:.3g}",
            traffic,
            f"{lay.idle_fraction:.1%}" if lay.idle_fraction else "",
            *((f"{lay.heal.payload_bytes / scale:.3g}" if lay.heal else "-",) if heal else ()),
            fits,
            style="bold green" if mark else None,
        )
    console = Console() if sys.stdout.isatty() else Console(width=140)  # pipes/files: don't squeeze to 80 columns
    console.print(table)
    console.print(_recommendation(best, args), soft_wrap=True)


def _print_ep(layouts, moe, *, state, device_memory, args) -> None:
    """The expert-parallel layouts: states per rank (dense, routed experts) and the all-to-all bytes per MoE layer."""
    from rich.console import Console
    from rich.table import Table

    from lightning_dist.planner import UNIFORM_ROUTING

    console = Console() if sys.stdout.isatty() else Console(width=140)
    head = (
        f"Mixture of experts: {moe.experts} experts per layer, top-{moe.top_k}, {moe.layers} MoE layers,"
        f" {moe.expert_params:,} expert parameters, hidden {moe.hidden}"
    )
    if not layouts:
        console.print(
            f"{head}: no ep layout (ep must divide {moe.experts} and dp_shard, or with tp be a multiple of tp with"
            " ep / tp dividing dp_shard).",
            soft_wrap=True,
        )
        return
    scale, unit = _unit(max(max(lay.total for lay in layouts), device_memory or 0))
    counted = args.batch_size is not None
    tokens = args.batch_size * args.seq_len if counted else None
    table = Table(
        title=f"{head}; memory in {unit}, traffic in bytes",
        caption="ep layouts (FSDP2 / HSDP with ep=; tpN-: TensorParallelStrategy with ep=, the dense parts split over"
        " tp): each group of ep consecutive dp_shard ranks (of dp_shard x tp when ep is a multiple of tp: each tp"
        " rank then dispatches 1/tp of the tokens, and the outputs and gradients are all-gathered over tp) holds every"
        " expert once, E/ep per rank, FSDP2-sharded over the ranks left. a2a/layer: all-to-all payload per MoE"
        " layer and step (counts + dispatch + combine, forward; both again in backward); a2a wire: what one rank sends"
        " per step, all layers (with the tp all-gathers); fsdp wire: FSDP2's gathers and reduce-scatters per step.",
    )
    for col in (
        "layout",
        "rep x shard x tp x ep",
        "experts/rank",
        "experts",
        "dense",
        "device",
        "a2a/layer",
        "a2a wire",
        "fsdp wire",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("layout", "rep x shard x tp x ep") else "right")
    for lay in layouts:
        per_layer = sum(c.payload_bytes for c in lay.per_layer)
        table.add_row(
            lay.name,
            f"{lay.dp_replicate}x{lay.dp_shard}x{lay.tp}x{lay.ep}",
            str(lay.experts_per_rank),
            f"{lay.experts.total / scale:.3g}",
            f"{lay.dense.total / scale:.3g}",
            f"{lay.total / scale:.3g}",
            f"{per_layer:,.0f}" if counted else "-",
            f"{sum(c.wire_bytes for c in (*lay.all_to_all, *lay.tp_gathers)):,.0f}" if counted else "-",
            f"{sum(c.wire_bytes for c in lay.fsdp):,.0f}",
            "-" if lay.fits is None else ("yes" if lay.fits else "no"),
        )
    console.print(table)
    a = state.gather
    if counted:
        rows = tokens * moe.top_k
        console.print(
            f"All-to-all per MoE layer and step on each rank, assuming {UNIFORM_ROUTING}: counts 8 x {moe.experts}"
            f" B; dispatch and combine {rows:,} rows x {moe.hidden} x {a:g} B each = {rows * moe.hidden * a:,.0f} B"
            f" (N = {tokens:,} tokens per rank x top-{moe.top_k}); the backward sends both again. tpN- rows with ep a"
            " multiple of N: 1/N of the rows per tp rank.",
            soft_wrap=True,
        )
    else:
        console.print(
            "All-to-all bytes not counted: give --batch-size, --seq-len (tokens per rank) and --hidden-size.",
            soft_wrap=True,
        )


def _plot_plan(layouts, best, *, path: str, device_memory: float | None, title: str) -> None:
    from lightning_dist._compat import matplotlib_available

    if not matplotlib_available():
        raise ValueError("--plot needs matplotlib: pip install 'lightning-dist[plot]'.")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [lay.name + (" *" if best is not None and lay.name == best.name else "") for lay in layouts]
    fig = Figure(figsize=(max(6.0, 0.6 * len(layouts) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # Agg canvas: renders without a display
    ax = fig.add_subplot()
    scale, unit = _unit(max(max(lay.memory.total + (lay.activations or 0) for lay in layouts), device_memory or 0))
    bottom = [0.0] * len(layouts)
    parts = {part: [getattr(lay.memory, part) for lay in layouts] for part in ("params", "grads", "optimizer")}
    if any(lay.activations is not None for lay in layouts):  # rows that cannot count them get no bar
        parts["activations"] = [lay.activations or 0.0 for lay in layouts]
    for part, values in parts.items():
        heights = [v / scale for v in values]
        ax.bar(names, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if device_memory:
        ax.axhline(device_memory / scale, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title(f"{title} (* = recommended)")
    ax.tick_params(axis="x", labelrotation=60)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    ax.legend()
    fig.savefig(path, dpi=100)


# ---- dry-run ----------------------------------------------------------------------------------------------
def _add_dry_run(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from lightning_dist.planner import PRECISIONS

    p = sub.add_parser(
        "dry-run",
        help="simulate one training step of each representative rank of a W-rank job on this CPU",
        description="Dry run at scale: each representative rank (first rank of every pipeline stage, and the last"
        " rank) runs in its own process on torch's fake process group: the strategy's own validation, the pack's"
        " mesh, the strategy's parallelize path on the meta device, then one training step on fake tensors with"
        " memory tracked and collectives recorded. Prints measured vs planned bytes. 1 GB = 1e9 B.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        metavar="CLASS_PATH",
        help="the LightningModule class: dotted path (my_pkg.models.GPT;"
        " the working folder is searched too) or a file with it (./my_model.py:Net)",
    )
    src.add_argument("--config", metavar="YAML", help="LightningCLI config: model, trainer.strategy, trainer.precision")
    p.add_argument("--init-args", metavar="JSON", default=None, help="keyword arguments of --model as a JSON object")
    p.add_argument("--strategy", default=None, help="registered strategy name (default hsdp) or class path")
    p.add_argument(
        "--strategy-args", metavar="JSON", default=None, help='strategy arguments, e.g. \'{"pp": 4, "tp": 8}\''
    )
    p.add_argument("--world-size", type=int, required=True, help="number of ranks of the simulated job")
    p.add_argument("--devices-per-node", type=int, required=True, help="devices per node")
    p.add_argument(
        "--precision",
        default=None,
        choices=sorted(PRECISIONS),
        metavar="PRECISION",
        help="Lightning precision flag (default: the config's, else bf16-mixed)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="samples per data-parallel rank per step (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's block_size)")
    p.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GB (1e9 B), 24GiB (2**30 B)")
    p.add_argument("--ranks", default=None, help="comma-separated ranks instead of the representative ones")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the tables")
    return p


def dry_run_config(args: argparse.Namespace):
    """A :class:`~lightning_dist.dryrun.DryRunConfig` from the command line (and a LightningCLI YAML)."""
    from lightning_dist import inputs
    from lightning_dist.dryrun import DryRunConfig

    strategy, strategy_args, precision = "hsdp", {}, "bf16-mixed"
    if args.config is not None:
        import yaml

        if args.init_args is not None:
            raise ValueError("--init-args goes with --model; with --config the init args come from the YAML.")
        class_path, init_args = inputs.model_spec_from_config(args.config)
        with open(args.config) as f:
            trainer = (yaml.safe_load(f) or {}).get("trainer") or {}
        spec = trainer.get("strategy", strategy)
        if isinstance(spec, dict):
            strategy, strategy_args = str(spec["class_path"]), dict(spec.get("init_args") or {})
        else:
            strategy = str(spec)
        precision = str(trainer.get("precision", precision))
    else:
        class_path = args.model
        init_args = json.loads(args.init_args) if args.init_args else {}
        if not isinstance(init_args, dict):
            raise ValueError(f"--init-args must be a JSON object; got {args.init_args!r}.")
    if args.strategy is not None:
        strategy = args.strategy
    if args.strategy_args is not None:
        strategy_args = json.loads(args.strategy_args)
        if not isinstance(strategy_args, dict):
            raise ValueError(f"--strategy-args must be a JSON object; got {args.strategy_args!r}.")
    return DryRunConfig(
        model=class_path,
        init_args=init_args,
        strategy=strategy,
        strategy_args=strategy_args,
        world_size=args.world_size,
        devices_per_node=args.devices_per_node,
        precision=args.precision or precision,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device_memory=inputs.parse_bytes(args.device_memory) if args.device_memory is not None else None,
        ranks=tuple(int(r) for r in args.ranks.split(",")) if args.ranks else None,
    )


def run_dry_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_dist.dryrun import dry_run

    config = dry_run_config(args)
    console = Console(stderr=True)
    with console.status(f"simulating ranks of {config.world_size} (one process per rank)"):
        report = dry_run(config)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format(width=140))
    fits = [report.fits(r) for r in report.ranks]
    return 1 if any(f is False for f in fits) else 0


# ---- consolidate ------------------------------------------------------------------------------------------
def _add_consolidate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one file a single-device Lightning run can load",
    )
    p.add_argument("src", help="sharded checkpoint directory written by a lightning-dist strategy")
    p.add_argument("dst", help="output file (written atomically)")
    return p


def run_consolidate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_dist.checkpoint import consolidate

    console = Console(stderr=True)
    with console.status("consolidating") as status:
        out = consolidate(args.src, args.dst, progress=lambda msg: status.update(msg))
    console.print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


# ---- registry ---------------------------------------------------------------------------------------------
# name -> (adds the subparser, runs it). Add new subcommands here.
SUBCOMMANDS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {
    "plan": (_add_plan, run_plan),
    "dry-run": (_add_dry_run, run_dry_run),
    "consolidate": (_add_consolidate, run_consolidate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-dist", description="lightning-dist tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in SUBCOMMANDS.items():
        add(sub).set_defaults(_run=run, _name=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-dist``; configuration errors exit with status 2 and the message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.exit(2, f"lightning-dist {args._name}: error: {err}\n")
    return 2  # unreachable: parser.exit raises SystemExit


if __name__ == "__main__":
    sys.exit(main())
