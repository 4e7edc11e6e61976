"""How the built-in plans transform the model, one type for every strategy: activation checkpointing, compile, the
tensor-parallel plan, expert parallelism (and its capacity factor). Declared once by ``MeshStrategy`` and checked
once, every problem listed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from lightning_dist.parallelize.ac import ACOption, ac_problems
from lightning_dist.parallelize.compile import check_compile_option
from lightning_dist.parallelize.tp.auto import BUILTIN_PLANS

TPPlan = Union[str, Mapping[str, Any]]


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What a strategy's built-in plan applies to the model (see ``MeshStrategy``'s arguments of the same names)."""

    activation_checkpointing: ACOption = False
    selective_ac_ops: Optional[Sequence[str]] = None
    offload_activations: bool = False
    compile: Union[bool, Sequence[str]] = False
    tp_plan: TPPlan = "auto"
    ep: int = 1
    ep_capacity_factor: Optional[float] = None

    def problems(self, *, parallelize_fn: Optional[Callable] = None, applies_tp_plan: bool = True) -> list[str]:
        """Every problem with these values (empty when valid); pure, the same on every rank.

        `parallelize_fn`: the user's replacement of the built-in plan, which then applies none of these;
        `applies_tp_plan`: False for a strategy that has no tensor-parallel plan to apply."""
        out = ac_problems(
            self.activation_checkpointing,
            selective_ops=self.selective_ac_ops,
            offload_activations=self.offload_activations,
        )
        out += check_compile_option(self.compile)
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            out.append(f"`ep={self.ep!r}` must be an integer >= 1 (the expert-parallel degree).")
        factor = self.ep_capacity_factor
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                out.append(
                    f"`ep_capacity_factor={factor!r}` must be a number > 0 (each expert takes at most"
                    " ceil(factor x a rank's routed pairs / experts) of them), or None to drop no token."
                )
            elif self.ep == 1:
                out.append(
                    f"`ep_capacity_factor={factor!r}` drops tokens in expert parallelism's dispatch, which `ep=1`"
                    " does not run: set `ep` > 1, or drop `ep_capacity_factor` (every token reaches its experts)."
                )
        plan = self.tp_plan
        if isinstance(plan, str) and plan != "auto" and plan not in BUILTIN_PLANS:
            out.append(
                f"`tp_plan={plan!r}` is not a built-in plan; use 'auto', one of {sorted(BUILTIN_PLANS)} or a mapping."
            )
        elif not isinstance(plan, (str, Mapping)):
            out.append(
                "`tp_plan` must be 'auto', a built-in plan name or a mapping of pattern -> style;"
                f" got {type(plan).__name__}."
            )
        elif plan != "auto" and not applies_tp_plan:
            out.append(
                "`tp_plan` is applied by TensorParallelStrategy and PipelineStrategy; this strategy has no"
                " tensor-parallel plan: use one of those (or drop tp_plan)."
            )
        if parallelize_fn is not None:
            given = [
                f"`{name}`"
                for name, value in (
                    ("activation_checkpointing", self.activation_checkpointing),
                    ("compile", self.compile),
                    ("offload_activations", self.offload_activations),
                    ("ep", self.ep != 1 and self.ep),
                )
                if value is not False
            ]
            if given:
                out.append(
                    f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} applied by the built-in plan, which"
                    " `parallelize_fn` replaces: call `lightning_dist.parallelize.apply_ac` / `apply_compile` /"
                    " `apply_offload_activations` (`parallelize.ep.apply_ep`) inside your parallelize_fn (after"
                    " tensor parallelism, before fully_shard) instead."
                )
        return out

    def normalized(self) -> ModelOptions:
        """A copy holding a mapping plan as a plain dict (a YAML mapping or a user's object)."""
        plan = dict(self.tp_plan) if isinstance(self.tp_plan, Mapping) else self.tp_plan
        return ModelOptions(
            activation_checkpointing=self.activation_checkpointing,
            selective_ac_ops=self.selective_ac_ops,
            offload_activations=self.offload_activations,
            compile=self.compile,
            tp_plan=plan,
            ep=self.ep,
            ep_capacity_factor=self.ep_capacity_factor,
        )


__all__ = ["ModelOptions", "TPPlan"]
