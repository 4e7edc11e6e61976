"""Offloading of model states (parameters, gradients, optimizer state) to host memory or NVMe.

Notes: docs/internals.md, "lightning_dist/parallelize/offload.py"."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from lightning_dist._compat import async_io_available
from lightning_dist._integrations.deepspeed import repoint_lr_scheduler
from lightning_dist.measure import PLACES, placement_mismatches

KINDS = ("parameters", "gradients", "optimizer")
Target = Optional[Literal["cpu", "nvme"]]
_PLACE_OF = {None: "device", "cpu": "host", "nvme": "nvme"}

# Adam(W) keeps two fp32 moments; ZeRO also keeps an fp32 master copy of each parameter partition
ADAM_STATE_BYTES = 8
MASTER_BYTES = 4
# DeepSpeed's swap files are padded and aligned; leave this much room above the estimate
DISK_MARGIN = 1.10

# precision flags DeepSpeed runs with on a CPU-only machine (its CPU accelerator has no fp16 kernels here)
DEEPSPEED_CPU_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Where the model states go."""

    optimizer: Target = "cpu"
    """Optimizer state (fp32 master copy and Adam moments): ``"cpu"``, ``"nvme"`` or None (stay on device)."""
    parameters: Target = None
    """Parameter partitions: ``"cpu"``, ``"nvme"`` or None; needs ``zero_stage=3``."""
    nvme_path: Optional[str] = None
    """Folder for the swap files when anything goes to ``"nvme"``; must exist and be writable."""
    zero_stage: int = 3
    """1: optimizer state sharded; 2: + gradients; 3: + parameters."""
    backend: Literal["deepspeed", "fsdp2"] = "deepspeed"
    """``"deepspeed"`` (ZeRO-Offload / ZeRO-Infinity) or ``"fsdp2"`` (FSDP2 ``CPUOffloadPolicy``)."""

    def problems(self) -> list[str]:
        """Every configuration problem, each with the value and the fix (empty when valid)."""
        out = []
        for name in ("optimizer", "parameters"):
            value = getattr(self, name)
            if value not in (None, "cpu", "nvme"):
                out.append(f'`{name}={value!r}` must be "cpu", "nvme" or None.')
        if self.backend not in ("deepspeed", "fsdp2"):
            out.append(f'`backend={self.backend!r}` must be "deepspeed" or "fsdp2".')
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (1, 2, 3):
            out.append(f"`zero_stage={self.zero_stage!r}` must be 1, 2 or 3.")
        elif self.parameters is not None and self.zero_stage != 3:
            out.append(
                f"`parameters={self.parameters!r}` offloads parameter partitions, which exist only with ZeRO stage 3;"
                f" got `zero_stage={self.zero_stage}`: pass `zero_stage=3` or `parameters=None`."
            )
        elif self.optimizer == "nvme" and self.backend == "deepspeed" and self.zero_stage != 3:
            out.append(
                f'`optimizer="nvme"` (ZeRO-Infinity) needs `zero_stage=3`; got `zero_stage={self.zero_stage}`:'
                ' pass `zero_stage=3` or `optimizer="cpu"`.'
            )
        uses_nvme = "nvme" in (self.optimizer, self.parameters)
        if uses_nvme and not self.nvme_path:
            out.append('Offloading to "nvme" needs `nvme_path=` (a folder on a fast local disk).')
        if self.nvme_path and not uses_nvme:
            out.append(f'`nvme_path={self.nvme_path!r}` is set but nothing is offloaded to "nvme".')
        if self.backend == "fsdp2":
            # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together, to host memory only
            if uses_nvme:
                out.append('backend="fsdp2" offloads to host memory only: use backend="deepspeed" for "nvme".')
            elif (self.optimizer, self.parameters) != ("cpu", "cpu"):
                out.append(
                    'backend="fsdp2" offloads parameters, gradients and optimizer state together: pass'
                    f' optimizer="cpu", parameters="cpu" (got optimizer={self.optimizer!r},'
                    f" parameters={self.parameters!r})."
                )
            if self.zero_stage == 1:
                out.append('backend="fsdp2" offloads sharded parameters: pass zero_stage=2 or 3.')
        return out

    def validate(self) -> OffloadPlan:
        problems = self.problems()
        if problems:
            raise ValueError("Invalid offload configuration:\n  - " + "\n  - ".join(problems))
        return self

    def place(self, kind: str) -> str:
        """``"device"``, ``"host"`` or ``"nvme"`` (:data:`~lightning_dist.measure.PLACES`) for ``kind`` in
        :data:`KINDS`."""
        if kind == "parameters":
            return _PLACE_OF[self.parameters]
        if kind == "optimizer":
            return _PLACE_OF[self.optimizer]
        # gradient partitions follow the optimizer to host memory; DeepSpeed never swaps gradients to disk
        return "device" if self.optimizer is None else "host"


@dataclass(frozen=True)
class RankStateBytes:
    """Bytes of one rank's model states, by kind and place: ``table[kind][place]``.

    (Not the planner's :class:`lightning_dist.planner.StateBytes`, which holds bytes per parameter element.)
    """

    table: Mapping[str, Mapping[str, int]]

    def total(self, *, place: Optional[str] = None, kind: Optional[str] = None) -> int:
        return sum(
            n for k, row in self.table.items() if kind in (None, k) for p, n in row.items() if place in (None, p)
        )


def estimate_states(
    num_params: int,
    *,
    plan: OffloadPlan,
    world_size: int,
    param_bytes: int = 4,
) -> RankStateBytes:
    """Per-rank bytes of the model states under ``plan`` (ZeRO arithmetic; activations not included).

    ``param_bytes``: bytes per element of the training parameters (4 for float32, 2 for bf16). The
    optimizer state is an fp32 master partition plus two fp32 Adam moments (12 bytes per element).
    """
    if world_size < 1 or num_params < 0:
        raise ValueError(f"estimate_states needs world_size >= 1 and num_params >= 0; got {world_size}, {num_params}.")
    shard = -(-num_params // world_size)  # ceil: ZeRO pads partitions to equal sizes
    params = (shard if plan.zero_stage == 3 else num_params) * param_bytes
    grads = (shard if plan.zero_stage >= 2 else num_params) * (4 if plan.optimizer else param_bytes)
    optim = shard * (ADAM_STATE_BYTES + MASTER_BYTES)
    table = {kind: dict.fromkeys(PLACES, 0) for kind in KINDS}
    for kind, n in zip(KINDS, (params, grads, optim)):
        table[kind][plan.place(kind)] += n
    return RankStateBytes(table)


def count_parameters(module: torch.nn.Module) -> int:
    """Elements of the trainable parameters (``ds_numel`` for DeepSpeed ZeRO-3 partitioned ones)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def check_nvme_path(path: str | os.PathLike, *, required_bytes: int, ranks_sharing: int = 1) -> Path:
    """Check the swap folder before anything is written: it exists, is a writable folder with room.

    ``required_bytes``: the estimated disk bytes of one rank; ``ranks_sharing``: ranks of this node that
    write into the same folder. Raises ValueError with the numbers; returns the resolved path.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ValueError(f"nvme_path={str(path)!r} does not exist: create the folder (on a local NVMe disk) first.")
    if not folder.is_dir():
        raise ValueError(f"nvme_path={str(path)!r} is not a folder: pass a folder on a local NVMe disk.")
    try:
        # os.access is not enough (root, read-only mounts): create and remove a probe file
        fd, probe = tempfile.mkstemp(prefix=".offload-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"nvme_path={str(path)!r} is not writable ({err.strerror}): pass a writable folder.") from None
    needed = int(required_bytes * ranks_sharing * DISK_MARGIN)
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(
            f"nvme_path={str(path)!r} has {_fmt(free)} free but the offloaded states need about {_fmt(needed)}"
            f" ({ranks_sharing} rank(s) x {_fmt(required_bytes)}, +{DISK_MARGIN - 1:.0%} margin): free space,"
            " choose another folder, or offload less."
        )
    return folder


def check_precision(precision: str, *, device_type: str) -> None:
    """Refuse precision flags DeepSpeed cannot run with on ``device_type``."""
    if device_type == "cpu" and precision not in DEEPSPEED_CPU_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by DeepSpeed on CPU (no float16 kernels, no float64):"
            f" use one of {', '.join(repr(p) for p in DEEPSPEED_CPU_PRECISIONS)}."
        )


LIBAIO_HINT = (
    'Offloading to "nvme" needs DeepSpeed\'s async_io op, which is built against libaio, and libaio was not'
    " found: install it (Debian/Ubuntu: `apt-get install -y libaio-dev`; Fedora/RHEL: `dnf install libaio-devel`),"
    ' or offload to "cpu" instead.'
)


def require_async_io() -> None:
    """Raise RuntimeError naming the package to install when libaio is missing."""
    if not async_io_available():
        raise RuntimeError(LIBAIO_HINT)


# ---- report ----------------------------------------------------------------------------------------
def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes held by the storages of ``tensors`` (each storage counted once; swapped-out ones hold 0)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def folder_bytes(path: Optional[str | os.PathLike]) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist)."""
    if not path or not os.path.isdir(path):
        return 0
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def offload_report(
    *,
    plan: OffloadPlan,
    resident: Mapping[str, Mapping[str, int]],
    nvme: Mapping[str, int],
    rank: int,
    device_type: str,
    cuda: Optional[Mapping[str, int]] = None,
) -> dict[str, Any]:
    """One rank's report row, measured: ``resident[kind]`` = bytes by where the tensors live
    (``{"device": .., "host": ..}``, from ``tensor.device``, see :func:`lightning_dist.measure.bytes_by_place`),
    ``nvme[kind]`` = bytes of its swap files, ``cuda`` = the CUDA allocator's allocated / peak bytes.

    The row holds the measured table next to the plan's place of each kind, and a ``mismatches`` line for
    each kind whose bytes mostly live elsewhere than planned. With a CPU device, device and host memory are
    the same RAM: the bytes are shown where the plan put them, ``measured_places`` is False and nothing is
    checked.
    """
    measured = device_type != "cpu"
    table = {}
    for kind in KINDS:
        where = plan.place(kind)
        row = dict.fromkeys(PLACES, 0)
        mem = resident.get(kind, {})
        if measured:
            row["device"] += int(mem.get("device", 0))
            row["host"] += int(mem.get("host", 0))
        else:
            row["host" if where in ("host", "nvme") else "device"] += sum(int(v) for v in mem.values())
        row["nvme"] += int(nvme.get(kind, 0))
        table[kind] = row
    planned = {kind: plan.place(kind) for kind in KINDS}
    mismatches = placement_mismatches(table, planned, device_type=device_type)
    return {
        "rank": rank,
        "table": table,
        "planned": planned,
        "measured_places": measured,
        "mismatches": mismatches,
        "cuda": dict(cuda) if cuda else None,
    }


def render_report(rows: Sequence[Mapping[str, Any]], *, title: str) -> Any:
    """A rich Table of the per-rank reports from :func:`offload_report`: measured bytes next to the plan."""
    from rich.table import Table

    caption = []
    if rows and not all(row.get("measured_places", True) for row in rows):
        caption.append("CPU device: device and host memory are the same RAM, bytes shown where planned")
    for row in rows:
        if row.get("cuda"):
            caption.append(
                f"rank {row['rank']}: CUDA allocated {_fmt(row['cuda']['allocated'])}, peak {_fmt(row['cuda']['peak'])}"
            )
    table = Table(title=title, caption="; ".join(caption) or None)
    table.add_column("rank", justify="right")
    table.add_column("state")
    table.add_column("planned")
    for place in PLACES:
        table.add_column(place, justify="right")
    table.add_column("check")
    for row in rows:
        bad = {line.split(":", 1)[0] for line in row.get("mismatches", ())}
        for kind in KINDS:
            cells = row["table"][kind]
            check = "MISMATCH" if kind in bad else ("ok" if row.get("measured_places", True) else "-")
            table.add_row(
                str(row["rank"]), kind, row.get("planned", {}).get(kind, "?"), *(_fmt(cells[p]) for p in PLACES), check
            )
    return table


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---- DeepSpeed's compiled CPU Adam ------------------------------------------------------------------
# per-parameter-group keys of torch's Adam/AdamW that DeepSpeedCPUAdam has no use for (its own flags are per optimizer)
_TORCH_ADAM_ONLY_KEYS = (
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def cpu_adam_options(optimizer: Any) -> tuple[Optional[dict], str]:
    """(DeepSpeedCPUAdam keyword arguments, why) for a torch optimizer; (None, why not) when it cannot replace it.

    Only torch's own ``Adam`` and ``AdamW`` (exact classes: a subclass may change the step), without the options
    DeepSpeedCPUAdam does not implement (``amsgrad``, ``maximize``). ``adamw_mode`` is AdamW's decoupled weight
    decay (``Adam(decoupled_weight_decay=True)`` too); plain Adam adds ``weight_decay * param`` to the gradient
    (L2), as DeepSpeedCPUAdam does with ``adamw_mode=False``. lr, betas, eps and weight_decay stay per group.
    """
    cls = type(optimizer)
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return None, f"{cls.__name__} is not torch.optim.Adam/AdamW"
    for flag in ("amsgrad", "maximize"):
        if any(group.get(flag) for group in optimizer.param_groups):
            return None, f"{cls.__name__}({flag}=True) is not implemented by DeepSpeedCPUAdam"
    if any(optimizer.state.values()):
        return None, f"{cls.__name__} has already stepped (its state would be lost)"
    decoupled = cls is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay", False))
    d = optimizer.defaults
    return {
        "lr": float(d["lr"]),
        "betas": tuple(d["betas"]),
        "eps": d["eps"],
        "weight_decay": d["weight_decay"],
        "adamw_mode": decoupled,
        "bias_correction": True,
    }, "Adam/AdamW"


def to_cpu_adam(optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> Optional[torch.optim.Optimizer]:
    """DeepSpeedCPUAdam over the same parameter groups and hyper-parameters, or None (see :func:`cpu_adam_options`).

    The compiled op is built on first use (about a minute) and cached under ``TORCH_EXTENSIONS_DIR``. An LR
    scheduler of `optimizer` is repointed to the new optimizer (its ``initial_lr`` keys travel with the groups).
    """
    options, _ = cpu_adam_options(optimizer)
    if options is None:
        return None
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [{k: v for k, v in group.items() if k not in _TORCH_ADAM_ONLY_KEYS} for group in optimizer.param_groups]
    for group in groups:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])  # a tensor lr (torch's capturable/fused option) is a float for the op
    adam = DeepSpeedCPUAdam(groups, **options)
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is optimizer:
        repoint_lr_scheduler(lr_scheduler, adam)
    return adam


def training_dtype(config: dict) -> torch.dtype:
    """The dtype DeepSpeed trains the parameters in (``zero.Init``'s dtype for this config)."""
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32
