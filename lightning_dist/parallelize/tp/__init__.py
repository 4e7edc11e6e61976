"""Tensor parallelism: plans (``plan``, ``auto``, ``styles``), their checks and self-checks, and ``apply_tp``."""

from lightning_dist.parallelize.tp.apply import apply_tp, apply_tp_entries, resolve_stage_plan

__all__ = ["apply_tp", "apply_tp_entries", "resolve_stage_plan"]
