"""DeepSpeed: each change to (or reach into) its private parts, as one small named function.

* :func:`self_contained_nvme_checkpoints`: ZeRO-3 checkpoint methods that save and restore NVMe-offloaded states;
* :func:`initialize_with_device_rank`: ``deepspeed.initialize`` given a device rank for one call (CPU devices);
* :func:`tolerate_missing_bit16_restore`: an evaluation engine's missing ``_restore_from_bit16_weights``;
* :func:`resize_param_swap_buffers`: the parameter swapper's page-locked buffers sized to the real partitions;
* :func:`repoint_lr_scheduler`: an LR scheduler moved onto ``DeepSpeedCPUAdam`` without torch's warning;
* :func:`use_cpu_accelerator`: DeepSpeed's CPU accelerator on a machine that also has CUDA;
* :func:`set_step_clip_norm`: the gradient-norm clipping of the ZeRO optimizer's next steps;
* :func:`zero_state_tensors`: the tensors of DeepSpeed's ZeRO partitions (for the offload report);
* :func:`param_partition_numels` / :func:`param_swappers`: ZeRO-3's per-parameter partitions and NVMe swappers.

Each refuses a DeepSpeed release outside :data:`lightning_dist._compat.DEEPSPEED_RANGE`
(:func:`~lightning_dist._compat.require_tested_deepspeed`); tests: ``tests/unit/test_integrations.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_dist._compat import require_tested_deepspeed

__all__ = [
    "initialize_with_device_rank",
    "repoint_lr_scheduler",
    "resize_param_swap_buffers",
    "self_contained_nvme_checkpoints",
    "set_step_clip_norm",
    "tolerate_missing_bit16_restore",
    "param_partition_numels",
    "param_swappers",
    "use_cpu_accelerator",
    "zero_state_tensors",
]


# ---- deepspeed.initialize ------------------------------------------------------------------------------
@contextmanager
def initialize_with_device_rank(device_rank: int) -> Generator[None, None, None]:
    """Within the block, ``deepspeed.initialize`` gets ``args.device_rank=device_rank`` where it is None.

    Reason: Lightning's ``_initialize_deepspeed_inference`` passes ``root_device.index``, None for a CPU device,
    and DeepSpeed's engine fails on it ("'>=' not supported between 'NoneType' and 'int'"); the module
    attribute is swapped for this one call because Lightning calls it by that name.
    """
    import deepspeed

    require_tested_deepspeed("deepspeed.initialize device-rank shim (initialize_with_device_rank)")
    initialize = deepspeed.initialize

    def initialize_with_rank(*args: Any, **kwargs: Any) -> Any:
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"] = argparse.Namespace(**{**vars(kwargs["args"]), "device_rank": device_rank})
        return initialize(*args, **kwargs)

    deepspeed.initialize = initialize_with_rank
    try:
        yield
    finally:
        deepspeed.initialize = initialize


def tolerate_missing_bit16_restore(zero: Any) -> None:
    """Give an evaluation engine's ZeRO-3 object a no-op ``_restore_from_bit16_weights`` when it lacks one.

    Reason: ``validate(ckpt_path=...)``: DeepSpeed's ``load_checkpoint`` without optimizer states loads the fp32
    weights into the module, then asks the optimizer to refresh its 16-bit copies; an evaluation engine
    (``DeepSpeedZeRoOffload``) has none and the method is missing (https://github.com/deepspeedai/DeepSpeed/issues/7272).
    """
    if zero is None or hasattr(zero, "_restore_from_bit16_weights"):
        return
    require_tested_deepspeed("_restore_from_bit16_weights stand-in (tolerate_missing_bit16_restore)")
    zero._restore_from_bit16_weights = lambda: None


def use_cpu_accelerator() -> None:
    """Make DeepSpeed use its CPU accelerator (it may have picked CUDA on a machine that has one).

    Reason: the offload strategy runs DeepSpeed on CPU devices; DeepSpeed picks its accelerator once, globally.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


# ---- gradient clipping --------------------------------------------------------------------------------------
def set_step_clip_norm(engine: Any, max_norm: float) -> None:
    """Make the engine's ZeRO optimizer clip the global gradient norm to ``max_norm`` in its next steps (0: off).

    Reason: DeepSpeed clips inside the ZeRO optimizer's step, by its ``clip_grad`` attribute (set once from
    the config's ``gradient_clipping`` at ``deepspeed.initialize``); no API changes it. Lightning puts
    ``Trainer(gradient_clip_val)`` in that config, but ``self.clip_gradients`` in manual optimization reaches
    the engine no other way.
    """
    require_tested_deepspeed("ZeRO optimizer clip_grad (set_step_clip_norm)")
    zero = getattr(engine, "optimizer", None)
    if not hasattr(zero, "clip_grad"):
        raise RuntimeError(
            f"DeepSpeed's optimizer {type(zero).__name__} has no `clip_grad`: gradient clipping cannot"
            " be set for its step (expected a ZeRO optimizer, stage 1-3)."
        )
    zero.clip_grad = float(max_norm)


# ---- reading ZeRO's partitions ---------------------------------------------------------------------------
def zero_state_tensors(engine: Any) -> dict[str, list[Any]]:
    """Every tensor of an engine's model states by kind: ``parameters``, ``gradients``, ``optimizer``.

    Reason: DeepSpeed keeps its partitions in attributes of the ZeRO optimizer and of each parameter
    (``ds_tensor``, ``fp32_partitioned_groups_flat``...), not behind an API; the offload report measures
    where they really live. Entries may be None (absent partitions).
    """
    require_tested_deepspeed("ZeRO partition attributes (zero_state_tensors)")
    zero_opt = engine.optimizer
    params = list(engine.module.parameters())
    masters = list(
        getattr(zero_opt, "fp32_partitioned_groups_flat", None)
        or getattr(zero_opt, "single_partition_of_fp32_groups", None)
        or []
    )
    inner = getattr(zero_opt, "optimizer", zero_opt)
    states = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in params] + [m.grad for m in masters]
    grads.append(getattr(zero_opt, "grad_partitions_flat_buffer", None))  # ZeRO-3's gradient partitions
    for group in getattr(zero_opt, "averaged_gradients", {}).values():  # ZeRO-1/2's reduced gradients
        grads.extend(group or [])
    # ZeRO-3 parameter partitions (`ds_tensor`), fp32 master partitions, gradient partitions, optimizer moments
    return {
        "parameters": [*params, *(getattr(p, "ds_tensor", None) for p in params)],
        "gradients": grads,
        "optimizer": [*masters, *states],
    }


def param_partition_numels(model: Any, world_size: int) -> list[int]:
    """Elements of each parameter's ZeRO-3 partition on this rank (``ceil(numel / world_size)`` before partitioning).

    Reason: ZeRO-3 stores the partition as the parameter's ``ds_tensor`` attribute (``ds_numel`` elements).
    """
    return [
        p.ds_tensor.ds_numel if getattr(p, "ds_tensor", None) is not None else -(-p.numel() // world_size)
        for p in model.parameters()
    ]


def param_swappers(model: Any) -> list[Any]:
    """The distinct NVMe swappers of a ZeRO-3 model's parameters (their ``nvme_swapper`` attribute)."""
    swappers = {id(s): s for p in model.parameters() if (s := getattr(p, "nvme_swapper", None)) is not None}
    return list(swappers.values())


# ---- DeepSpeedCPUAdam --------------------------------------------------------------------------------
def repoint_lr_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``lr_scheduler`` at ``optimizer`` (a ``DeepSpeedCPUAdam`` replacing the user's Adam).

    Reason: torch's scheduler marks ``optimizer.step`` in its constructor and warns at its first step that
    ``optimizer.step()`` "has been overridden after learning rate scheduler initialization" when the mark
    is missing; it checks only the two private attributes set here.
    """
    lr_scheduler.optimizer = optimizer
    step = optimizer.step

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


# ---- ZeRO-3 parameter swapper ----------------------------------------------------------------------------
def resize_param_swap_buffers(swapper: Any, numel: int) -> None:
    """Reallocate the page-locked buffers of DeepSpeed's parameter swapper for partitions of ``numel`` elements.

    Only while every buffer is free (after ``zero.Init`` has written all partitions to NVMe); DeepSpeed 0.19's
    ``AsyncPartitionedParameterSwapper`` keeps them as one tensor of ``buffer_count`` equal slices.
    Reason: a model built in ``configure_model`` gets its buffers before its partition sizes are known, and
    DeepSpeed has no call to resize them (page-locked, resident all the time).
    """
    require_tested_deepspeed("parameter swap-buffer resize (resize_param_swap_buffers)")
    needed = (
        "buffers",
        "available_buffer_ids",
        "param_buffer_count",
        "param_id_to_swap_buffer",
        "inflight_params",
        "elements_per_buffer",
        "aligned_elements_per_buffer",
        "aio_read_handle",
        "_io_aligned_numel",
    )
    if not all(hasattr(swapper, name) for name in needed):
        return  # another DeepSpeed: keep its buffers
    busy = (
        len(swapper.available_buffer_ids) != swapper.param_buffer_count
        or swapper.param_id_to_swap_buffer
        or swapper.inflight_params
    )
    aligned = swapper._io_aligned_numel(numel)
    if busy or aligned == swapper.aligned_elements_per_buffer:
        return
    old = swapper.buffers
    swapper.buffers = swapper.aio_read_handle.new_cpu_locked_tensor(aligned * swapper.param_buffer_count, old)
    swapper.elements_per_buffer, swapper.aligned_elements_per_buffer = numel, aligned
    swapper.aio_read_handle.free_cpu_locked_tensor(old)


# ---- ZeRO-3 checkpoints of NVMe-offloaded states -----------------------------------------------------
def self_contained_nvme_checkpoints(engine: Any) -> None:
    """Make DeepSpeed's ZeRO-3 checkpoints of NVMe-offloaded states complete and loadable (DeepSpeed 0.19).

    Reason: DeepSpeed 0.19 saves placeholders for NVMe-resident states and restores them by swap-file name
    (no upstream issue filed); replaces two methods of the engine's ZeRO-3 optimizer and one of the engine.

    What DeepSpeed does by itself, and why it is wrong:

    * **save**: the optimizer file stores ``fp32_partitioned_groups_flat`` and the Adam moments as they are
      between steps, i.e. the empty placeholders the NVMe swapper leaves in memory (``zero_to_fp32`` finds
      no fp32 partition); the real values only exist in a copy of the swap folder (``offloaded_tensors/``)
      whose files are named after ``ds_id``, a counter of the process (another model, or a second
      ``fit`` in the same process, numbers its tensors differently);
    * **load**: with the optimizer on NVMe it skips the optimizer file entirely and copies those files
      back by name. The torch optimizer's state (the ``step`` counts, and the list of tensors the swapper
      reads back) is never restored, so the moments restart from zero, and files whose names do not match
      are never read: the resumed weights are the new run's initial ones;
    * with only the parameters on NVMe, ``_rigid_load_state_dict`` writes into the flat parameter buffers
      of the sub-groups, which do not exist (None) when the parameters are swapped.

    The fix, with DeepSpeed's own swap calls: the optimizer file is made self-contained (each sub-group's
    state swapped in, copied, released: one sub-group in memory at a time, the checkpoint of a rank in
    memory while it is written, as for host-memory offload), the copy of the swap folder is skipped, and
    the load goes through the optimizer file again, writing each sub-group's fp32 master and moments to
    this run's swap files and its parameters to memory or to their own swap files.
    """
    import types

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    zero = engine.optimizer
    if not isinstance(zero, DeepSpeedZeroOptimizer_Stage3):
        return
    require_tested_deepspeed("ZeRO-3 NVMe checkpoint methods (self_contained_nvme_checkpoints)")
    zero._rigid_state_dict = types.MethodType(_nvme_rigid_state_dict, zero)
    zero._rigid_load_state_dict = types.MethodType(_nvme_rigid_load_state_dict, zero)
    # the engine asks this only around checkpoints (and for AutoEP, not used here): True copies the swap
    # folder into the checkpoint on save and, on load, skips the optimizer file for that copy (see above);
    # everything is in the optimizer file now
    engine.zero_nvme_offload_optimizer = lambda: False


def _check_swapper(zero: Any) -> None:
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    if zero.swap_optimizer and not isinstance(zero.optimizer_swapper, PartitionedOptimizerSwapper):
        raise NotImplementedError(
            "Checkpoints of an NVMe-offloaded optimizer need DeepSpeed's default swapper: remove"
            " `pipeline_read` / `pipeline_write` from `offload_optimizer` in the DeepSpeed config."
        )


def _nvme_rigid_state_dict(self: Any) -> dict:
    """``DeepSpeedZeroOptimizer_Stage3._rigid_state_dict`` with the swapped-out fp32 partitions and states in."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT

    _check_swapper(self)
    # DeepSpeed's dict: placeholders (numel 0) for what is on NVMe; its lists/dicts alias live objects
    sd = type(self)._rigid_state_dict(self)
    if not self.swap_optimizer:
        return sd
    flats = list(sd[FP32_FLAT_GROUPS])
    osd = sd[OPTIMIZER_STATE_DICT]
    state = dict(osd["state"])
    # `_rigid_state_dict` put sub-group i's fp32 partition, in order, into param group
    # `sub_group_to_group_id[i]`: its index in the packed state dict follows from that
    seen: dict[int, int] = {}
    for i, flat in enumerate(self.fp32_partitioned_groups_flat):
        group = self.sub_group_to_group_id[i]
        index = osd["param_groups"][group]["params"][seen.get(group, 0)]
        seen[group] = seen.get(group, 0) + 1
        if not self._swappable_optimizer_subgroup(i):
            continue  # kept in memory: already in the dict
        self.optimizer_swapper.swap_in_optimizer_state(parameter=flat)
        try:
            flats[i] = flat.detach().clone()
            if flat in self.optimizer.state:
                state[index] = {
                    k: v.detach().clone() if torch.is_tensor(v) else v for k, v in self.optimizer.state[flat].items()
                }
        finally:
            self._release_swap_buffers(i)  # back to placeholders, nothing rewritten to disk
    sd[FP32_FLAT_GROUPS] = flats
    sd[OPTIMIZER_STATE_DICT] = {**osd, "state": state}
    return sd


def _nvme_rigid_load_state_dict(self: Any, state_dict: dict, load_optimizer_states: bool = True) -> None:
    """``DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict`` for states and parameters on NVMe."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

    _check_swapper(self)
    saved = state_dict[FP32_FLAT_GROUPS]
    if len(saved) != len(self.fp32_partitioned_groups_flat) or any(
        s.numel() != n for s, n in zip(saved, self.fp16_partitioned_groups_flat_numel)
    ):
        raise RuntimeError(
            "This ZeRO-3 checkpoint does not hold the fp32 partitions of this model (saved with NVMe offload"
            " before they were written into the checkpoint, or for another model / sub_group_size)."
        )
    self.loss_scaler = state_dict[LOSS_SCALER]
    self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
    self.overflow = state_dict["overflow"]
    if load_optimizer_states:
        self._set_fp32_optimizer_param_groups()
        self.optimizer.load_state_dict(state_dict[OPTIMIZER_STATE_DICT])
        self._clear_fp32_optimizer_param_groups()
    if self.swap_optimizer:
        # forget the state tensors registered for this run's swap files: the swap-out below registers the
        # loaded ones (torch's `load_state_dict` replaced the tensors in `optimizer.state`)
        self.optimizer_swapper.purge_state()
    self._partition_all_parameters()
    for i, flat in enumerate(self.fp32_partitioned_groups_flat):
        if self._swappable_optimizer_subgroup(i):
            _swap_in_without_reading(self, flat, fp32=saved[i])
        else:
            flat.data.copy_(saved[i].data)
        # fp32 master -> working parameters, in memory or written to their NVMe swap files
        self._reassign_or_swap_out_partitioned_parameters(i)
        if self._swappable_optimizer_subgroup(i):
            # writes the fp32 master and the loaded optimizer states to this run's swap files, frees them
            self.optimizer_swapper.swap_out_optimizer_state(parameter=flat)


def _swap_in_without_reading(self: Any, flat: torch.Tensor, *, fp32: torch.Tensor) -> None:
    """Put a sub-group's fp32 partition (``fp32``) and its loaded optimizer states into pinned swap buffers.

    ``swap_in_optimizer_state`` without the reads: the swap files of the loaded states may not exist yet
    (a fresh run has taken no step), and ``swap_out_optimizer_state`` writes only from such buffers (with
    none pinned it waits on no I/O and aborts).
    """
    swapper = self.optimizer_swapper
    info = swapper._get_param_swap_info(flat)  # registers the loaded state tensors of `optimizer.state[flat]`
    values = [fp32.data] + [t.data for t in info.get_compute_tensors()[1:]]
    aligned = swapper._io_aligned_numel(info.numel())
    buffers = swapper.swap_buffer_manager.allocate(num_elems=aligned, count=info.num_tensors(), dtype=flat.dtype)
    if buffers is None:
        raise RuntimeError(
            f"Not enough NVMe swap buffers for {info.num_tensors()} optimizer tensors: raise"
            " `offload_optimizer.buffer_count` in the DeepSpeed config."
        )
    info.swap_buffers = buffers.copy()
    info.set_swap_buffers(buffers, aligned)
    for tensor, value in zip(info.get_compute_tensors(), values):
        tensor.data.copy_(value.to(dtype=tensor.dtype))
