"""Tensor parallelism: plans (``plan``, ``auto``, ``styles``), their checks and self-checks, and ``apply.apply_tp``."""
