"""Complete, loadable DeepSpeed ZeRO-3 checkpoints when optimizer state or parameters are offloaded to NVMe.

DeepSpeed 0.19 saves placeholders for NVMe-resident states and restores them by swap-file name; see
:func:`self_contained_nvme_checkpoints` for what goes wrong and how the optimizer's two checkpoint methods
are replaced, using DeepSpeed's own swap calls (hand-written because DeepSpeed has no such path).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dist._compat import deepspeed_nvme_checkpoint_patch_tested

__all__ = ["self_contained_nvme_checkpoints"]


def self_contained_nvme_checkpoints(engine: Any) -> None:
    """Make DeepSpeed's ZeRO-3 checkpoints of NVMe-offloaded states complete and loadable (DeepSpeed 0.19).

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
    if not deepspeed_nvme_checkpoint_patch_tested():
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn("The NVMe checkpoint methods of lightning-dist were tested with DeepSpeed 0.19.x only; check"
                       " that a resumed run matches an uninterrupted one (tests/scenarios/offload_parity.py --resume).")
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
                state[index] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                for k, v in self.optimizer.state[flat].items()}
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
        raise RuntimeError(f"Not enough NVMe swap buffers for {info.num_tensors()} optimizer tensors: raise"
                           " `offload_optimizer.buffer_count` in the DeepSpeed config.")
    info.swap_buffers = buffers.copy()
    info.set_swap_buffers(buffers, aligned)
    for tensor, value in zip(info.get_compute_tensors(), values):
        tensor.data.copy_(value.to(dtype=tensor.dtype))
