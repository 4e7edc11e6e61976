"""Lightning's precision flag, read in one place: the dtypes it stores parameters and computes in.

Strategies (FSDP2's mixed-precision policy), the planner (bytes per parameter), callbacks (tolerances,
planned bytes) and the DeepSpeed offload (swap sizes) all ask this module instead of parsing the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class PrecisionDtypes:
    """What a precision flag means for the tensors: ``param`` is stored, ``compute`` runs the math."""

    param: torch.dtype
    """dtype of the parameters the module holds (``*-mixed`` keeps float32)."""
    compute: torch.dtype
    """dtype of the forward/backward math (autocast, or FSDP2's ``MixedPrecisionPolicy.param_dtype``)."""

    @property
    def param_bytes(self) -> int:
        return self.param.itemsize

    @property
    def compute_bytes(self) -> int:
        return self.compute.itemsize

    @property
    def mixed(self) -> bool:
        """True when the math runs in a lower precision than the stored parameters."""
        return self.compute != self.param


# Lightning's flags and their short aliases ("bf16" == "bf16-mixed", as Lightning accepts them)
PRECISION_DTYPES: dict[str, PrecisionDtypes] = {
    "64-true": PrecisionDtypes(torch.float64, torch.float64),
    "64": PrecisionDtypes(torch.float64, torch.float64),
    "32-true": PrecisionDtypes(torch.float32, torch.float32),
    "32": PrecisionDtypes(torch.float32, torch.float32),
    "bf16-mixed": PrecisionDtypes(torch.float32, torch.bfloat16),
    "bf16": PrecisionDtypes(torch.float32, torch.bfloat16),
    "16-mixed": PrecisionDtypes(torch.float32, torch.float16),
    "16": PrecisionDtypes(torch.float32, torch.float16),
    "bf16-true": PrecisionDtypes(torch.bfloat16, torch.bfloat16),
    "16-true": PrecisionDtypes(torch.float16, torch.float16),
}


def precision_flag(obj: Any, *, default: str = "32-true") -> str:
    """The precision flag of a Trainer, strategy, precision plugin or string; ``default`` when unknown."""
    for attr in ("precision_plugin", "precision"):  # strategy -> plugin -> flag; trainer.precision is the flag
        if not isinstance(obj, str) and hasattr(obj, attr):
            obj = getattr(obj, attr)
    flag = str(obj) if isinstance(obj, (str, int)) else ""
    return flag if flag in PRECISION_DTYPES else default


def precision_dtypes(obj: Any, *, default: Optional[str] = "32-true") -> Optional[PrecisionDtypes]:
    """:class:`PrecisionDtypes` of ``obj``'s flag (see :func:`precision_flag`); None for an unknown flag
    when ``default`` is None."""
    flag = precision_flag(obj, default="")
    if not flag:
        return None if default is None else PRECISION_DTYPES[default]
    return PRECISION_DTYPES[flag]
