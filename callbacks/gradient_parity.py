"""Check, inside a real run, that the distributed gradient equals the single-device gradient.

Notes: docs/internals.md, "callbacks/gradient_parity.py"."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist.callbacks._global_batch import (
    batch_rows,
    concat_batches,
    padding_keep_mask,
    same_values,
    select_rows,
    to_cpu,
    to_device,
)
from lightning_dist.callbacks._reference_model import full_tensor_of, unsharded_clone, whole_pipeline_network
from lightning_dist.callbacks.sync_batchnorm import revert_sync_batchnorm
from lightning_dist.mesh import DistMesh, data_parallel_info
from lightning_dist.parallelize.pipeline.split import pipeline_view
from lightning_dist.parallelize.shared import retie, shared_parameters
from lightning_dist.precision import precision_dtypes

__all__ = ["GradientParityCheck", "GradientParityError", "default_tolerance"]

_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for a parameter dtype: rounding of a different reduction order, with margin."""
    return _TOLERANCE.get(dtype, 1e-4)


def _compute_dtype(trainer: Trainer, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the step computes in: a mixed/half precision flag lowers it below the parameters'."""
    dtypes = precision_dtypes(trainer, default=None)
    return dtypes.compute if dtypes is not None and dtypes.compute_bytes == 2 else param_dtype


class GradientParityError(RuntimeError):
    """The distributed gradient differs from the single-device gradient of the same global batch."""


class GradientParityCheck(Callback):
    """At chosen optimizer steps, compare the distributed gradient with the single-device gradient.

    The global batch is every data-parallel rank's micro-batches of that optimizer step (all of them
    under gradient accumulation), gathered over the ``dp`` group; rows that a ``DistributedSampler`` added
    as padding are removed, as a single-device run would never see them. An unsharded copy of the model
    (synced BatchNorm turned into plain BatchNorm) computes the gradient of the mean loss of the
    micro-batches of that global batch; the distributed gradient is gathered from the shards. Parameters tied
    in the model as the user built it (recorded at ``setup``, before any parallelization) are tied in the
    copy: a correctly tied model passes, and a tie that the parallelization broke shows as a mismatch. The relative
    difference ``||g_dist - g_ref|| / ||g_ref||`` is logged as ``grad_parity/rel_diff`` and kept in
    :attr:`results`; above the tolerance the callback raises :class:`GradientParityError` (or warns).
    It also checks that the parameters are identical on every data-parallel rank and that the ranks did
    not all receive the same batch (unsharded data).

    Example::

        from lightning_dist.callbacks import GradientParityCheck

        trainer = Trainer(strategy="ddp", devices=4, callbacks=[GradientParityCheck(steps=(0, 100))])

    Supported (each checked in the tests): DDP (and single device); ``hsdp``/``fsdp2`` and ``tp`` (DTensor
    parameters and gradients, sharded over ``tp`` and the data-parallel dims, gathered with
    ``full_tensor()``; the batch is gathered over ``dp`` only, as tensor-parallel peers hold the same
    samples); ``pipeline`` (pp x dp): every rank holds only its stages' parameters, so the stage copies
    are gathered over ``pp`` (``all_gather_object`` of CPU copies) and joined into the whole network,
    which runs the model's own forward as on one device; each rank compares its own parameters
    and the squared differences are summed over the stages. Parameter equality is checked over the ranks
    that hold the same parameters (the world; under pipeline each stage's ``dp`` group). Not supported,
    with an error at setup: DeepSpeed (the pack's ``offload``), FSDP1, and tensor parallelism under
    Lightning's own ``ModelParallelStrategy``. Every rank recomputes the reference on its own device, so
    the unsharded model and the global batch must fit there (under pipeline the whole model also
    passes through CPU memory once). The loss is ``training_step(batch, batch_idx)`` run on the copy
    (``self.log`` is a no-op there and ``self.trainer`` is not available; under pipeline the network
    call runs the whole network locally, so this is the single-device loss that ``pipeline_loss`` must
    reproduce per micro-batch); pass ``loss_fn(module, batch) -> loss`` for manual optimization or a
    training step that needs the trainer. Dropout or other randomness in the forward makes the two
    gradients differ: disable it for the checked steps.
    """

    def __init__(
        self,
        *,
        steps: Sequence[int] = (0,),
        on_mismatch: str = "raise",
        tolerance: Optional[float] = None,
        loss_fn: Optional[Callable[[LightningModule, Any], Tensor]] = None,
    ) -> None:
        if on_mismatch not in ("raise", "warn"):
            raise ValueError(f"`on_mismatch={on_mismatch!r}` must be 'raise' or 'warn'.")
        if tolerance is not None and not tolerance > 0:
            raise ValueError(f"`tolerance={tolerance!r}` must be a positive number (or None for the dtype default).")
        steps = tuple(steps)
        if not steps or any(not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"`steps={steps!r}` must be a non-empty list of optimizer step numbers >= 0.")
        self.steps = frozenset(steps)
        """Optimizer steps (``trainer.global_step`` before the step) at which to check."""
        self.on_mismatch = on_mismatch
        """``"raise"`` a :class:`GradientParityError` or ``"warn"`` when the difference is above tolerance."""
        self.tolerance = tolerance
        """Relative tolerance; None: by compute dtype (float64 1e-10, float32 1e-4, fp16 1e-2, bf16 3e-2)."""
        self.loss_fn = loss_fn
        """``loss_fn(module, batch) -> scalar loss``; None: the model's ``training_step``."""
        self.results: list[dict[str, Any]] = []
        """One entry per checked step: step, rel_diff, tolerance, ok, worst parameter, params_equal."""
        self._micro: list[tuple[Any, Optional[Tensor], int]] = []
        self._ties: Optional[list[tuple[str, ...]]] = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # the tied parameters of the model as the user built it (before any parallelization, which runs
        # after this hook): the reference keeps them tied, so a tie the strategy broke shows as a mismatch
        if isinstance(pl_module, nn.Module) and any(True for _ in pl_module.parameters()):
            self._ties = shared_parameters(pl_module)
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

        if isinstance(trainer.strategy, (DeepSpeedStrategy, FSDPStrategy)):
            raise ValueError(
                f"GradientParityCheck cannot read whole gradients under {type(trainer.strategy).__name__} (they live"
                " in flat partitioned buffers). Use it with ddp, hsdp/fsdp2, tp, pipeline or Lightning's"
                " ModelParallelStrategy."
            )
        mesh = getattr(trainer.strategy, "mesh", None)
        if isinstance(mesh, DistMesh) and mesh.size("pp") > 1 and pipeline_view(trainer.strategy) is None:
            raise ValueError(
                f"GradientParityCheck: the mesh has pp={mesh.size('pp')} but the strategy is"
                f" {type(trainer.strategy).__name__}; pipeline stages are supported under the pack's"
                " PipelineStrategy (strategy='pipeline') only."
            )
        device_mesh = getattr(trainer.strategy, "_device_mesh", None)  # Lightning's ModelParallelStrategy
        dim_names = () if isinstance(mesh, DistMesh) or device_mesh is None else (device_mesh.mesh_dim_names or ())
        if "tensor_parallel" in dim_names and device_mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "GradientParityCheck does not support tensor parallelism under Lightning's ModelParallelStrategy"
                " (tensor_parallel > 1); use the pack's strategy='tp', which it supports."
            )
        if not pl_module.automatic_optimization and self.loss_fn is None:
            raise ValueError(
                "GradientParityCheck: with manual optimization pass `loss_fn=lambda module, batch: ...` (the"
                " training_step steps the optimizer itself and cannot be replayed)."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step not in self.steps:
            return
        self._micro.append((to_cpu(batch), padding_keep_mask(trainer, batch_idx), batch_idx))

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if trainer.global_step not in self.steps or not self._micro:
            return
        micro, self._micro = self._micro, []
        group, size, _ = data_parallel_info(trainer.strategy)
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]

        # the distributed gradient and parameters, whole (every rank joins the same collectives)
        full_params = {n: full_tensor_of(p.detach()) for n, p in named}
        dist_grads = {n: None if p.grad is None else full_tensor_of(p.grad.detach()) for n, p in named}
        # ranks holding the same parameters: the world, or under pipeline the dp group of each stage
        pipeline = pipeline_view(trainer.strategy) is not None
        same_params_group, same_params_size = (group, size) if pipeline else (None, _world_size())
        params_equal = self._params_equal(full_params, same_params_group, same_params_size)
        if pipeline and _world_size() > 1:  # one verdict on every stage
            t = torch.tensor([int(params_equal)], device=pl_module.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            params_equal = bool(t.item())

        # the global batch: each micro-batch of every dp rank, padded rows dropped
        gathered = [micro]
        if size > 1:
            gathered = [None] * size
            dist.all_gather_object(gathered, micro, group=group)
        global_batches = [
            (concat_batches([select_rows(g[k][0], g[k][1]) for g in gathered]), micro[k][2]) for k in range(len(micro))
        ]

        # every dp rank holding the same rows means the data is not sharded (no DistributedSampler)
        same_batch = size > 1 and all(
            same_values(g[k][0], gathered[0][k][0]) for g in gathered[1:] for k in range(len(micro))
        )

        ref_grads = self._reference_grads(trainer, pl_module, full_params, global_batches)
        diff_sq, ref_sq, worst, worst_rel = self._compare_sums(dist_grads, ref_grads)
        if pipeline and trainer.strategy.mesh.size("pp") > 1:  # every stage holds different parameters: add them up
            pp_group = trainer.strategy.mesh.group("pp")
            sums = torch.tensor([diff_sq, ref_sq], dtype=torch.float64, device=pl_module.device)
            dist.all_reduce(sums, group=pp_group)
            diff_sq, ref_sq = float(sums[0]), float(sums[1])
            worsts = [None] * trainer.strategy.mesh.size("pp")
            dist.all_gather_object(worsts, (worst_rel, worst), group=pp_group)
            worst_rel, worst = max(worsts)
        rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)
        if _world_size() > 1:  # one verdict on every rank (a rank with different parameters sees another value)
            t = torch.tensor([rel], dtype=torch.float64, device=pl_module.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rel = float(t.item())
        dtype = _compute_dtype(trainer, next(iter(full_params.values())).dtype if full_params else torch.float32)
        tol = self.tolerance if self.tolerance is not None else default_tolerance(dtype)
        ok = rel <= tol and params_equal and not same_batch
        self.results.append(
            {
                "step": trainer.global_step,
                "rel_diff": rel,
                "tolerance": tol,
                "ok": ok,
                "worst": worst,
                "params_equal": params_equal,
                "same_batch_on_all_ranks": same_batch,
                "global_batch": sum(batch_rows(b) for b, _ in global_batches),
            }
        )
        pl_module.log("grad_parity/rel_diff", rel, on_step=True, on_epoch=False, sync_dist=False)
        if ok:
            return
        msg = (
            f"GradientParityCheck at step {trainer.global_step}: relative gradient difference {rel:.3e} vs the"
            f" single-device gradient (tolerance {tol:.1e} for {dtype}); largest in `{worst}`."
        )
        if ref_sq == 0.0:  # the ratio above is then the distributed gradient's norm over the 1e-30 floor
            msg += (
                " The single-device copy's loss gave no gradient at all (every reference gradient is zero), so"
                " this figure says nothing about the strategy: the loss of `training_step` (or `loss_fn`) on the"
                " copy does not depend on the copy's parameters, e.g. it calls a network held outside the"
                " LightningModule's modules, or detaches the loss. Pass `loss_fn=lambda module, batch: ...`."
            )
        if not params_equal:
            msg += " The parameters differ between ranks that should hold the same values."
        if same_batch:
            msg += (
                f" All {size} data-parallel ranks received the same batch: the training data is not sharded"
                " (no DistributedSampler; build it from `trainer.strategy.distributed_sampler_kwargs`)."
            )
        msg += (
            " Common causes: the loss not divided under accumulation, per-shard BatchNorm statistics (use"
            " MeshSyncBatchNorm), padded duplicate samples in the training batch, a rank-dependent model change."
        )
        if self.on_mismatch == "raise":
            raise GradientParityError(msg)
        warnings.warn(msg, stacklevel=2)

    # ---- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _params_equal(full_params: dict[str, Tensor], group: Any, size: int) -> bool:
        if size == 1 or not full_params:
            return True
        # a fingerprint of every parameter; different values almost surely change it
        fp = torch.stack([p.double().sum() + (p.double() ** 2).sum() * math.pi for p in full_params.values()])
        gathered = [torch.empty_like(fp) for _ in range(size)]
        dist.all_gather(gathered, fp.contiguous(), group=group)
        return all(torch.equal(g, gathered[0]) for g in gathered)

    def _reference_grads(
        self, trainer: Trainer, pl_module: LightningModule, full_params: dict[str, Tensor], batches: list
    ) -> dict[str, Optional[Tensor]]:
        by_id = {id(p): full_params[n] for n, p in pl_module.named_parameters() if n in full_params}
        ref = unsharded_clone(pl_module, by_id, {})
        device = next(iter(full_params.values())).device if full_params else pl_module.device
        strategy = trainer.strategy
        view = pipeline_view(strategy)
        if view is not None:  # this rank holds its stages only: join every stage's copy into the network
            setattr(
                ref, view.network, whole_pipeline_network(view, strategy.mesh, getattr(ref, view.network)).to(device)
            )
        # tied as the user built the model (setup), else as the parallelized model still is
        ties = self._ties if self._ties is not None else shared_parameters(pl_module)
        present = dict(ref.named_parameters(remove_duplicate=False))
        retie(ref, [names for names in ties if all(n in present for n in names)])
        ref = revert_sync_batchnorm(ref)
        ref.train()
        ref.zero_grad(set_to_none=True)
        with trainer.precision_plugin.train_step_context(), warnings.catch_warnings():
            # the copy has no trainer, so its `self.log` is a no-op: Lightning's warning about that is not the user's
            warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)` but the `self.trainer`")
            for batch, batch_idx in batches:
                batch = to_device(batch, device)
                if self.loss_fn is not None:
                    loss = self.loss_fn(ref, batch)
                else:
                    out = ref.training_step(batch, batch_idx)
                    loss = out["loss"] if isinstance(out, Mapping) else out
                if not isinstance(loss, Tensor):
                    raise TypeError(
                        f"GradientParityCheck needs a loss tensor, the step returned {type(loss).__name__}."
                    )
                (loss / len(batches)).backward()  # the mean over micro-batches, like Lightning's accumulation
        # every name of a tied parameter gives the one (summed) gradient: a strategy that broke the tie holds
        # two parameters whose gradients are each a part of it, and fails the comparison
        params = dict(ref.named_parameters(remove_duplicate=False))
        return {n: None if params[n].grad is None else params[n].grad.detach() for n in full_params}

    @staticmethod
    def _compare_sums(dist_grads: dict, ref_grads: dict) -> tuple[float, float, str, float]:
        """(sum of squared differences, sum of squared reference values, worst parameter, its relative diff)."""
        diff_sq, ref_sq, worst, worst_rel = 0.0, 0.0, "", -1.0
        for n, g in dist_grads.items():
            r = ref_grads.get(n)
            if g is None and r is None:
                continue
            g = torch.zeros_like(r) if g is None else g.double()
            r = torch.zeros_like(g) if r is None else r.to(g.device).double()
            d = float((g - r).pow(2).sum())
            rs = float(r.pow(2).sum())
            diff_sq, ref_sq = diff_sq + d, ref_sq + rs
            rel_n = math.sqrt(d) / max(math.sqrt(rs), 1e-30)
            if rel_n > worst_rel:
                worst, worst_rel = n, rel_n
        return diff_sq, ref_sq, worst, worst_rel


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
