"""OffloadStrategy: optimizer-state and parameter offloading to host memory or NVMe, on CPU machines too.

Notes: docs/internals.md, "lightning_dist/strategies/offload.py"."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_dist._compat import CUDA_AVAILABLE
from lightning_dist._integrations import deepspeed as ds_patches
from lightning_dist._integrations import lightning as lightning_patches
from lightning_dist._integrations.torch_distributed import destroy_process_groups_at_exit
from lightning_dist.atomic import swap_in
from lightning_dist.launcher import JobLauncher, die_with_launcher, record_rank_error
from lightning_dist.measure import bytes_by_place, cuda_memory
from lightning_dist.parallelize import offload as off
from lightning_dist.strategies._offload_nvme import NvmeSwapMixin
from lightning_dist.strategies._offload_report import OffloadReportMixin
from lightning_dist.strategies._processes import as_timeout


def _refuse_clip_by_value(optimizer: Any, clip_val: Any) -> None:
    raise ValueError(
        f"OffloadStrategy clips gradients by norm only (DeepSpeed clips inside its step); got"
        f" clip_gradients(gradient_clip_val={clip_val!r}, gradient_clip_algorithm='value'). Use"
        " gradient_clip_algorithm='norm', or strategy='offload_fsdp2', which also clips by value."
    )


class OffloadStrategy(OffloadReportMixin, NvmeSwapMixin, DeepSpeedStrategy):
    """Offload optimizer state and/or parameters to host memory or NVMe (``Trainer(strategy="offload")``).

    Args:
        optimizer: where the optimizer state (fp32 master copy, Adam moments) and gradient partitions
            live: ``"cpu"`` (host memory), ``"nvme"`` (swap files under ``nvme_path``) or None.
        parameters: where the parameter partitions live between uses: ``"cpu"``, ``"nvme"`` or None;
            needs ``zero_stage=3``.
        nvme_path: folder on a fast local disk for the swap files; checked (exists, writable, room for
            the estimated states) on every rank before the process group starts.
        zero_stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
        backend: ``"deepspeed"``. The FSDP2 backend is the class :class:`FSDP2OffloadStrategy`
            (``Trainer(strategy="offload_fsdp2")``); asking this class for ``"fsdp2"`` raises and says so.
            (A constructor that returned the other class confused LightningCLI's signature reading.)
        sub_group_size: elements per optimizer step group; with NVMe only one group's state is in memory
            at a time, so smaller groups lower the peak memory.
        report: print the offload report when training starts and ends.
        cpu_adam: on a CUDA machine with the optimizer state offloaded, run the step with DeepSpeed's compiled
            ``DeepSpeedCPUAdam`` when ``configure_optimizers`` returns torch's ``Adam``/``AdamW`` (lr, betas,
            eps, weight_decay per group and AdamW vs Adam carried over; an LR scheduler follows). The op is
            compiled on first use (about a minute) and cached under ``TORCH_EXTENSIONS_DIR``. False: keep the
            torch optimizer.
        compile: refused with a ValueError unless False (see :class:`FSDP2OffloadStrategy` ``compile=True``).
        **kwargs: other options of Lightning's ``DeepSpeedStrategy`` (``params_buffer_size``, ``timeout``...)

    DeepSpeed options set for the offloaded step: ``overlap_comm=True`` and ``contiguous_gradients=True``
    (Lightning's defaults, kept: the gradient reduction and the device-to-host copies of the gradient
    partitions overlap the backward pass instead of following it), ``pin_memory=True`` on CUDA (page-locked
    host buffers, so those copies and the parameter uploads after the CPU step are asynchronous DMA; pinning
    needs an accelerator, hence off on CPU-only machines).

    With ``parameters="nvme"`` the DeepSpeed defaults (made for GPU servers with host memory to spare) are
    replaced by memory-lean ones, unless given (as an argument, or as a key of a ``config``):

    * ``max_in_cpu=0``: DeepSpeed's default keeps up to 1e9 parameter elements per rank in host memory,
      i.e. every parameter of most models, with only a copy on NVMe;
    * ``zero_optimization.stage3_max_reuse_distance=0``: parameters are released after each use instead
      of kept from the forward to the backward pass. Kept ones hold one of the ``params_buffer_count``
      swap buffers each: with more swapped parameters than buffers, DeepSpeed fails ("Not enough buffers");
    * ``params_buffer_size``: the largest parameter partition once the model is known (the swap buffers are
      page-locked, ``params_buffer_count`` of them, resident all the time); while ``configure_model`` builds
      the model, ``1e7`` elements (Lightning's ``1e8`` locks 2 GB per rank in float32).
    """

    strategy_name = "offload"

    def __init__(
        self,
        *,
        optimizer: off.Target = "cpu",
        parameters: off.Target = None,
        nvme_path: Optional[str] = None,
        zero_stage: Literal[1, 2, 3] = 3,
        backend: Literal["deepspeed", "fsdp2"] = "deepspeed",
        sub_group_size: int = 100_000_000,
        report: bool = True,
        cpu_adam: bool = True,
        compile: Any = False,
        timeout: Any = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        if compile is not False:
            raise ValueError(
                f"OffloadStrategy(compile={compile!r}): per-block torch.compile is not supported with the DeepSpeed"
                " backend (ZeRO-3 gathers and releases parameters in hooks inside each module's call, which the"
                " compiled blocks would trace). Use `Trainer(strategy=FSDP2OffloadStrategy(compile=True))`"
                ' ("offload_fsdp2"), or compile=False.'
            )
        if backend == "fsdp2":
            raise ValueError(
                'OffloadStrategy(backend="fsdp2"): the FSDP2 backend is its own class. Use'
                ' `FSDP2OffloadStrategy(optimizer="cpu", parameters="cpu")` or `Trainer(strategy="offload_fsdp2")`'
                " (class_path: lightning_dist.strategies.FSDP2OffloadStrategy)."
            )
        self.plan = off.OffloadPlan(
            optimizer=optimizer, parameters=parameters, nvme_path=nvme_path, zero_stage=zero_stage, backend=backend
        ).validate()
        # the parameter-swap options the user chose (a config of their own, or arguments): never overridden
        user_config = kwargs.get("config") is not None or DeepSpeedStrategy.DEEPSPEED_ENV_VAR in os.environ
        chosen = {"buffer_size": "params_buffer_size" in kwargs, "max_in_cpu": "max_in_cpu" in kwargs}
        super().__init__(
            stage=zero_stage,
            offload_optimizer=optimizer is not None,
            offload_parameters=parameters is not None,
            offload_optimizer_device=optimizer or "cpu",
            offload_params_device=parameters or "cpu",
            nvme_path=nvme_path or "",
            pin_memory=CUDA_AVAILABLE,  # page-locked host buffers: async copies; pinning needs an accelerator
            sub_group_size=sub_group_size,
            # seconds or a timedelta, as for every strategy of the pack (an explicit argument: LightningCLI reads
            # the **kwargs passed on to DeepSpeedStrategy from this call's source)
            timeout=as_timeout(timeout, type(self).__name__),
            **kwargs,
        )
        assert isinstance(self.config, dict)
        # a torch optimizer (configure_optimizers) may run on offloaded state: DeepSpeedCPUAdam where it can
        # (`cpu_adam`, CUDA), the torch optimizer elsewhere
        self.config["zero_force_ds_cpu_optimizer"] = False
        self.cpu_adam = cpu_adam
        self._user_buffer_size = chosen["buffer_size"]
        if parameters == "nvme":
            self._lean_nvme_params(None if user_config else chosen)
        self.report = report
        self._configured_clip: Optional[float] = None  # DeepSpeed's gradient_clipping once fit is set up

    # ---- the three changes that let Lightning's DeepSpeedStrategy run on a CPU-only machine ---------
    @override
    def setup_environment(self) -> None:
        # every check before the first collective, on every rank
        off.check_precision(self.precision_plugin.precision, device_type=self.root_device.type)
        if "nvme" in (self.plan.optimizer, self.plan.parameters):
            if self.lightning_module is not None:
                self._check_nvme(self.lightning_module)
            off.require_async_io()
        # Lightning's DeepSpeedStrategy refuses non-CUDA accelerators here: go to DDPStrategy's directly
        DDPStrategy.setup_environment(self)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # the pack's launcher: no rank outlives the job
        lightning_patches.replace_default_launcher(
            self, lambda: JobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        record_rank_error(exception, self.global_rank)  # the launcher (or torchrun) names this rank's error

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning_dist.callbacks.sync_batchnorm import sync_or_warn_batchnorm

        if trainer.state.fn == TrainerFn.FITTING:  # DeepSpeed's data parallelism spans the world
            group = torch.distributed.group.WORLD if self.world_size > 1 else None
            sync_or_warn_batchnorm(
                self.lightning_module, sync=self._layer_sync is not None, group=group, dp_size=self.world_size
            )
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # DeepSpeed clips by norm inside its step (Trainer(gradient_clip_val) is in its config); Lightning's
            # DeepSpeed precision ignores `self.clip_gradients`: here it sets the norm of the next step
            self._configured_clip = float(self.config.get("gradient_clipping") or 0.0)
            lightning_patches.route_gradient_clipping(
                self.precision_plugin, by_norm=self._clip_next_step, by_value=_refuse_clip_by_value
            )

    def _clip_next_step(self, optimizer: Any, clip_val: Any) -> None:
        ds_patches.set_step_clip_norm(self.deepspeed_engine, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._configured_clip is not None:  # a manual step's clipping (self.clip_gradients) lasts that step
            ds_patches.set_step_clip_norm(self.deepspeed_engine, self._configured_clip)
        return out

    @override
    def setup_distributed(self) -> None:
        die_with_launcher()  # a child rank goes down with the launching process
        # Lightning validates CUDA device indices here; a CPU device has none
        if self.root_device.type != "cpu":
            super().setup_distributed()
        else:
            ds_patches.use_cpu_accelerator()
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()
        destroy_process_groups_at_exit()  # a gloo worker thread would otherwise abort the exit of a healthy job

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[Any, Any]:
        import deepspeed

        self._prepare_nvme(model)
        optimizer = self._cpu_step_optimizer(optimizer, lr_scheduler)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        if "nvme" in (self.plan.optimizer, self.plan.parameters):
            ds_patches.self_contained_nvme_checkpoints(engine)
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        """``validate`` / ``test`` / ``predict`` without ``fit``: Lightning's, with a device rank DeepSpeed accepts."""
        self._prepare_nvme(model)
        # Lightning passes `args.device_rank=root_device.index` here too: None for a CPU device
        with ds_patches.initialize_with_device_rank(self._device_rank()):
            super()._initialize_deepspeed_inference(model)
        # ZeRO-3 without an optimizer (DeepSpeedZeRoOffload): `validate(ckpt_path=...)` asks it for a method it lacks
        ds_patches.tolerate_missing_bit16_restore(getattr(self.model, "optimizer", None))

    def _cpu_step_optimizer(self, optimizer: Optional[torch.optim.Optimizer], lr_scheduler: Any) -> Any:
        """The optimizer for the offloaded step: DeepSpeedCPUAdam for torch's Adam/AdamW on CUDA, else `optimizer`."""
        if not self.cpu_adam or optimizer is None or self.plan.optimizer is None or self.root_device.type != "cuda":
            return optimizer
        adam = off.to_cpu_adam(optimizer, lr_scheduler)
        if adam is None:
            rank_zero_info(
                f"offload: the CPU step keeps {type(optimizer).__name__} ({off.cpu_adam_options(optimizer)[1]})"
                "; torch.optim.Adam/AdamW would run as DeepSpeedCPUAdam, several times faster."
            )
            return optimizer
        rank_zero_info(
            f"offload: the CPU step runs {type(optimizer).__name__} as DeepSpeedCPUAdam"
            f" (adamw_mode={adam.adam_w_mode})."
        )
        return adam

    def _device_rank(self) -> int:
        # Lightning passes `root_device.index`, None for a CPU device; DeepSpeed needs a number
        return self.root_device.index if self.root_device.index is not None else self.local_rank

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with super().model_sharded_context():
            try:
                yield
            except AssertionError as err:
                # DeepSpeed's swapper asserts when a parameter partition is larger than its NVMe swap buffers
                if "than buffer size" not in str(err):
                    raise
                raise ValueError(
                    f"A parameter partition does not fit the NVMe swap buffers of the parameters ({err}): pass"
                    " `params_buffer_size=` at least the largest parameter's number of elements divided by the"
                    " number of processes (for a model built in `configure_model`)."
                ) from err

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """DeepSpeed's sharded checkpoint folder (offloaded states included, NVMe too), written atomically.

        Every rank writes into ``<filepath>.partial``; rank 0 renames it once all are done, so a failure
        never leaves a half-written checkpoint under ``filepath``. Load it on one device with Lightning's
        ``convert_zero_checkpoint_to_fp32_state_dict``.
        """
        final = str(self.broadcast(filepath))
        partial = final + ".partial"
        if self.is_global_zero and os.path.exists(partial):
            shutil.rmtree(partial)
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.is_global_zero:
            swap_in(partial, final)
        self.barrier()

    # ---- report --------------------------------------------------------------------------------
    def offload_report(self) -> dict[str, Any]:
        """This rank's bytes of parameters / gradients / optimizer state by place (memory measured, disk files)."""
        # where DeepSpeed's partitions really live (tensor.device)
        tensors = ds_patches.zero_state_tensors(self.deepspeed_engine)
        resident = {kind: bytes_by_place(tensors[kind]) for kind in ("parameters", "gradients", "optimizer")}
        return off.offload_report(
            plan=self.plan,
            resident=resident,
            nvme=self._disk_bytes(),
            rank=self.global_rank,
            device_type=self.root_device.type,
            cuda=cuda_memory(self.root_device),
        )
