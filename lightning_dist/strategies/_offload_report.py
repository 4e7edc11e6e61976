"""The offload report both offload strategies print when training starts and ends (rank-0 rich table)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dist.parallelize import offload as off


class OffloadReportMixin:
    """The offload report at fit start and end: each rank's ``offload_report()``, a rank-0 rich table."""

    plan: off.OffloadPlan
    report: bool

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.report:
            self.print_report("start of fit")

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.report:
            self.print_report("end of fit")

    def print_report(self, title: str) -> list[dict[str, Any]]:
        """Gather every rank's report (a collective) and print it on rank 0; returns the rows."""
        rows = [None] * self.world_size
        torch.distributed.all_gather_object(rows, self.offload_report())
        if self.is_global_zero:
            _print_table(off.render_report(rows, title=f"Offload report, {title} ({describe_plan(self.plan)})"))
            wrong = [f"rank {row['rank']}: {line}" for row in rows for line in row["mismatches"]]
            if wrong:
                rank_zero_warn(
                    f"Offload report ({title}): states not where the plan puts them:\n  - " + "\n  - ".join(wrong)
                )
        return rows


def describe_plan(plan: off.OffloadPlan) -> str:
    return f"{plan.backend}, ZeRO-{plan.zero_stage}, optimizer->{plan.optimizer}, parameters->{plan.parameters}"


def _print_table(table: Any) -> None:
    from rich.console import Console

    Console().print(table)
