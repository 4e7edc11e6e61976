"""The dry run's report: measured next to planned bytes per simulated rank, as rich tables or a dict."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from lightning_dist.mesh import DP

if TYPE_CHECKING:
    from lightning_dist.dryrun import DryRunConfig


@dataclass(frozen=True, kw_only=True)
class DryRunReport:
    """Measured and planned figures of each simulated rank."""

    config: DryRunConfig
    ranks: list[dict[str, Any]]
    """One :func:`simulate_rank` result per rank (``planned`` holds the planner's figures)."""

    @staticmethod
    def need(rank: dict[str, Any]) -> float:
        """The bytes a rank needs: model states (after the step) + peak activations, or MemTracker's whole peak
        when larger (a pipeline holds the last step's gradients through its schedule, until Lightning's
        ``zero_grad`` after ``training_step``: two sets of gradients at its peak)."""
        return max(rank["states"]["total"] + rank["peak_activation_bytes"], rank.get("peak_total_bytes", 0))

    def fits(self, rank: dict[str, Any]) -> Optional[bool]:
        if self.config.device_memory is None:
            return None
        return self.need(rank) <= self.config.device_memory

    def collective_ratios(self, rank: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float]]:
        """(op, dim) -> (measured, planned) payload bytes of one rank (groups of one rank left out)."""
        out: dict[tuple[str, str], list[float]] = {}
        for c in rank["collectives"]:
            if c.get("group_size", 2) > 1:
                out.setdefault((c["op"], c["dim"]), [0.0, 0.0])[0] += c["payload_bytes"]
        for c in rank["planned"]["collectives"]:
            out.setdefault((c["op"], c["dim"]), [0.0, 0.0])[1] += c["payload_bytes"]
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def format(self, width: int = 140) -> str:
        """Rich tables: per rank memory (measured / planned) and collectives per (op, dim)."""
        from rich.console import Console
        from rich.table import Table

        cfg = self.config
        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=False)
        mesh = " x ".join(f"{k}={v}" for k, v in self.ranks[0]["mesh"].items()) if self.ranks else ""
        mem = f", device memory {cfg.device_memory / 1e9:.4g} GB" if cfg.device_memory else ""
        table = Table(
            title=f"Dry run: {cfg.model.rsplit('.', 1)[-1]} on {cfg.world_size} ranks ({mesh},"
            f" {cfg.devices_per_node}/node), strategy {cfg.strategy}, {cfg.precision}{mem}",
            caption="bytes per rank, measured on fake tensors / planned (lightning_dist.planner);"
            " activations: peak saved activations + backward temporaries; total: states + activations, or"
            " MemTracker's whole peak when larger. 1 GB = 1e9 B.",
        )
        for col in (
            "rank",
            "coords",
            "params",
            "grads",
            "optim",
            "states m/p",
            "peak act",
            "act m/p",
            "total",
            "fits",
            "time",
        ):
            table.add_column(col, justify="left" if col == "coords" else "right", no_wrap=True)
        for r in self.ranks:
            m, p = r["states"], r["planned"]["states"]
            act, act_p = r["peak_activation_bytes"], r["planned"]["peak_activation_bytes"]
            fits = self.fits(r)
            table.add_row(
                str(r["rank"]),
                " ".join(f"{k}{v}" for k, v in r["coords"].items() if k != DP),
                *(format_bytes(m[k]) for k in ("params", "grads", "optimizer")),
                f"{m['total'] / p['total']:.3f}" if p["total"] else "-",
                format_bytes(act),
                f"{act / act_p:.2f}" if act_p else "-",
                format_bytes(self.need(r)),
                "-" if fits is None else ("yes" if fits else "NO"),
                f"{r['seconds']:.0f} s",
            )
        console.print(table)
        for r in self.ranks:
            staged, planned = r.get("checkpoint_staging_bytes"), r["planned"].get("checkpoint_staging_bytes")
            if staged is not None:
                console.print(
                    f"rank {r['rank']}: async_checkpoint=True stages {format_bytes(staged)} in host memory per save"
                    f" (planned {format_bytes(planned or 0)}), held until the write finishes"
                )
        for r in self.ranks:
            healed, planned = r.get("heal_bytes"), r["planned"].get("heal_bytes")
            if healed is not None:
                ratio = f", {healed / planned:.3f}" if planned else ""
                console.print(
                    f"rank {r['rank']}: fault_tolerance: a heal sends {format_bytes(healed)} from this rank to the"
                    f" matching rank of a healing replica group (planned {format_bytes(planned or 0)}{ratio}): its"
                    " model and optimizer shards, once per heal; the dp_replicate rows below are the all-reduce"
                    f" across the {r['replica_groups']} replica groups (torchft's)"
                )
        routing = next((r["routing"] for r in self.ranks if r.get("routing")), None)
        comm = Table(
            title="Collective payload bytes per step (measured / planned)",
            # fake tensors hold no router choices: the experts' rows (ep's all-to-alls) follow an assumed routing
            caption=f"mixture of experts: the experts' rows (ep's all-to-all bytes) assume {routing}; the peak leaves"
            " out the routed experts' own activations (they run outside the fake mode MemTracker counts in)"
            if routing
            else None,
        )
        for col in ("rank", "op", "dim", "calls", "measured", "planned", "m/p"):
            comm.add_column(col, justify="left" if col in ("op", "dim") else "right", no_wrap=True)
        for r in self.ranks:
            calls = {(c["op"], c["dim"]): c["calls"] for c in r["collectives"]}
            for (op, dim), (meas, plan) in self.collective_ratios(r).items():
                comm.add_row(
                    str(r["rank"]),
                    op,
                    dim,
                    str(calls.get((op, dim), 0)),
                    format_bytes(meas),
                    format_bytes(plan),
                    f"{meas / plan:.3f}" if plan else "-",
                )
        console.print(comm)
        return buf.getvalue()

    def to_dict(self) -> dict[str, Any]:
        return {"config": json.loads(self.config.to_json()), "ranks": self.ranks}


def format_bytes(n: float) -> str:
    """Decimal units: 1 kB = 1e3 B, 1 GB = 1e9 B."""
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
