"""Benchmark: activation checkpointing modes on one training step of the pack's GPT, side by side in one run.

    python benchmarks/activation_checkpointing.py [--json out.json] [--plot out.png] [--steps 5] [--layers 8]
        [--width 256] [--seq 256] [--batch 4] [--dtype float32]

For each of ``activation_checkpointing=`` none / ``"full"`` / ``"selective"`` / ``"every:2"`` (applied with
:func:`lightning_dist.parallelize.apply_ac`, as every strategy does) on the same weights and batch:

* peak activation bytes of one forward + backward, measured with torch's ``MemTracker``
  (:mod:`torch.distributed._tools.mem_tracker`, the tracker ``lightning-dist dry-run`` uses): the
  ``Activation`` category (tensors saved for backward and selective AC's kept outputs) at the step's peak,
  and ``Activation + Temp`` (with the temporaries live at that moment), next to the planner's
  :func:`lightning_dist.planner.activation_bytes` for the mode;
* step time (forward + backward): the median over ``--steps`` rounds, the modes interleaved in each round so
  that a busy machine slows them alike;
* gradients against the no-AC step (max relative difference; all modes compute the same function).

Ratios are against no AC. The issue's goal for ``"selective"``: <= 60% of no-AC's activations at <= 1.15x its
step time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_dist import planner
from lightning_dist.models.gpt import GPT
from lightning_dist.parallelize.ac import apply_ac, parse_ac

MODES = ("none", "full", "selective", "every:2")


def build(base: GPT, mode: str) -> GPT:
    model = copy.deepcopy(base)
    plan = parse_ac(False if mode == "none" else mode)
    if plan is not None:
        apply_ac(model, mode=plan.mode, every=plan.every)
    return model


def step(model: GPT, idx: torch.Tensor) -> None:
    logits = model(idx)
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()


def peak_activations(model: GPT, idx: torch.Tensor) -> tuple[int, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step(model, idx)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    cat = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    model.zero_grad(set_to_none=True)
    return cat.get("Activation", 0), cat.get("Activation", 0) + cat.get("Temp", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (each runs every mode once)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    parser.add_argument("--plot", default=None, help="draw activations and step time per mode into this PNG")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = GPT(vocab_size=65, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width).to(dtype)
    idx = torch.randint(0, 65, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    models = {mode: build(base, mode) for mode in MODES}

    grads = {}
    for mode, model in models.items():  # one untimed step each: warm-up and the gradients to compare
        step(model, idx)
        grads[mode] = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    memory = {mode: peak_activations(model, idx) for mode, model in models.items()}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.steps):
        for mode, model in models.items():
            start = time.perf_counter()
            step(model, idx)
            times[mode].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)

    shape = planner.BlockShape(hidden=args.width, heads=args.heads, mlp_hidden=4 * args.width, vocab=65)
    size = torch.empty((), dtype=dtype).element_size()
    params = sum(p.numel() * p.element_size() for p in base.parameters())
    rows = []
    none_act, none_time = memory["none"][0], statistics.median(times["none"])
    for mode in MODES:
        act, act_temp = memory[mode]
        med = statistics.median(times[mode])
        planned = planner.activation_bytes(
            shape,
            tokens=args.batch * args.seq,
            blocks=args.layers,
            bytes_per_element=size,
            checkpointed=False if mode == "none" else mode,
        )
        diff = max(
            ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for g, r in zip(grads[mode], grads["none"])
        )
        rows.append(
            {
                "mode": mode,
                "activation_bytes": act,
                "activation_plus_temp_bytes": act_temp,
                "activation_ratio": act / none_act,
                "step_s": med,
                "time_ratio": med / none_time,
                "planned_activation_bytes": planned,
                "planned_over_measured": planned / act,
                "grad_rel_diff_vs_none": diff,
            }
        )
    print(
        f"GPT {args.layers} blocks x width {args.width}, {args.heads} heads, batch {args.batch} x seq {args.seq},"
        f" {args.dtype}; parameters {params / 2**20:.1f} MiB; {args.steps} timed rounds (median)"
    )
    header = (
        f"{'mode':<10} {'activations':>12} {'+temp':>12} {'act/none':>9} {'step s':>8} {'time/none':>10}"
        f" {'planned':>12} {'plan/meas':>10} {'grad diff':>10}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['mode']:<10} {r['activation_bytes'] / 2**20:>10.1f}Mi"
            f" {r['activation_plus_temp_bytes'] / 2**20:>10.1f}Mi"
            f" {r['activation_ratio']:>9.3f} {r['step_s']:>8.3f} {r['time_ratio']:>10.3f}"
            f" {r['planned_activation_bytes'] / 2**20:>10.1f}Mi {r['planned_over_measured']:>10.3f}"
            f" {r['grad_rel_diff_vs_none']:>10.1e}"
        )
    sel = next(r for r in rows if r["mode"] == "selective")
    goal = sel["activation_ratio"] <= 0.60 and sel["time_ratio"] <= 1.15
    print(
        f"goal (selective <= 0.60 x activations at <= 1.15 x step time): {'met' if goal else 'NOT met'}"
        f" ({sel['activation_ratio']:.3f}, {sel['time_ratio']:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows, "goal_met": goal}, f, indent=2)
    if args.plot:
        plot(rows, args.plot, title=f"GPT {args.layers} x {args.width}, batch {args.batch} x {args.seq}, {args.dtype}")
        print(f"Saved the figure to {args.plot}")


def plot(rows: list[dict], path: str, *, title: str) -> None:
    """Two panels per mode: measured and planned peak activations (MiB), and step time against no AC."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6), layout="constrained")
    FigureCanvasAgg(fig)  # renders without a display
    memory, time_ax = fig.subplots(1, 2)
    modes = [r["mode"] for r in rows]
    at = range(len(rows))
    memory.bar([i - 0.2 for i in at], [r["activation_bytes"] / 2**20 for r in rows], 0.4, label="measured")
    memory.bar([i + 0.2 for i in at], [r["planned_activation_bytes"] / 2**20 for r in rows], 0.4, label="planner")
    memory.set_xticks(list(at), modes)
    memory.set_ylabel("peak saved activations (MiB)")
    memory.legend()
    time_ax.bar(modes, [r["time_ratio"] for r in rows], color="tab:gray")
    time_ax.axhline(1.0, color="black", linewidth=0.8)
    time_ax.set_ylabel("step time / no AC")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
