"""torch's ring attention (``torch.distributed.tensor.experimental``'s context parallelism), driven directly.

Reason: torch's public ``context_parallel`` reaches its ring attention only through DTensor dispatch of the CUDA SDPA
kernels (flash, efficient, cuDNN): on CPU it fails ("no sharding strategy registered" for the CPU flash kernel), and
it shards the buffers it is handed rather than the inputs a model is called with. The ring itself (torch's
``_templated_ring_attention`` and its backward: the key/value rotation, the load-balanced causal blocks, the
log-sum-exp merge) takes the attention kernel as an argument, so the pack calls it with the kernel of the device:
CPU's flash kernel (every floating dtype, float64 included: exact to round-off), CUDA's flash (half precision) or
memory-efficient (float32) kernel with the arguments torch's own CUDA wrappers pass. Nothing of the ring is
rewritten here; only the kernel choice and the options are the pack's. Load balancing is torch's head-tail order,
the order of :func:`~lightning_dist.rules.cp_chunks` (rank r holds chunks r and 2cp - 1 - r).

On a torch release outside :data:`~lightning_dist._compat.TORCH_PIPELINING_TESTED` it refuses with the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_dist._compat import check_torch_ring_attention

_aten = torch.ops.aten


@dataclass(frozen=True)
class RingKernel:
    """One SDPA kernel pair as torch's ring functions call it: ``forward(q, k, v, is_causal=..., **fwd)`` returning
    (out, logsumexp, *rest) and ``backward(query=, key=, value=, out=, logsumexp=, is_causal=, **bwd)``; `rest` names
    the forward's extra outputs the backward takes (CUDA flash: sequence offsets, RNG state)."""

    name: str
    forward: Any
    backward: Any
    grad_out_name: str
    forward_kwargs: Callable[[Optional[float]], dict]
    backward_kwargs: Callable[[Optional[float], tuple], dict]


_CPU_FLASH = RingKernel(
    "flash (CPU)",
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    "grad_out",
    lambda scale: {"dropout_p": 0.0, "scale": scale},
    lambda scale, rest: {"dropout_p": 0.0, "scale": scale},
)


def _cuda_flash_backward_kwargs(scale: Optional[float], rest: tuple) -> dict:
    # torch's own wrapper (`_scaled_dot_product_ring_flash_attention_backward`) passes the forward's extra outputs
    cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset = rest[:6]
    return dict(
        cum_seq_q=cum_seq_q,
        cum_seq_k=cum_seq_k,
        max_q=max_q,
        max_k=max_k,
        dropout_p=0.0,
        philox_seed=philox_seed,
        philox_offset=philox_offset,
        scale=scale,
    )


_CUDA_FLASH = RingKernel(
    "flash (CUDA)",
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_backward.default,
    "grad_out",
    lambda scale: {"dropout_p": 0.0, "return_debug_mask": False, "scale": scale},
    _cuda_flash_backward_kwargs,
)


def _cuda_efficient_backward_kwargs(scale: Optional[float], rest: tuple) -> dict:
    # torch's own wrapper (`_scaled_dot_product_ring_efficient_attention_backward`) passes these
    philox_seed, philox_offset = rest[:2]
    return dict(
        attn_bias=None,
        philox_seed=philox_seed,
        philox_offset=philox_offset,
        dropout_p=0.0,
        grad_input_mask=(True, True, True, False),
        scale=scale,
    )


_CUDA_EFFICIENT = RingKernel(
    "memory-efficient (CUDA)",
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_efficient_attention_backward.default,
    "grad_out_",
    lambda scale: {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0, "scale": scale},
    _cuda_efficient_backward_kwargs,
)


def ring_kernel(device_type: str, dtype: torch.dtype) -> RingKernel:
    """The kernel torch's ring runs on `device_type` for `dtype`; RuntimeError naming the fix where none serves."""
    if device_type == "cpu":
        return _CPU_FLASH
    if device_type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            return _CUDA_FLASH
        if dtype == torch.float32:
            return _CUDA_EFFICIENT
        raise RuntimeError(
            f"cp_style='ring' on CUDA runs torch's flash (float16/bfloat16) or memory-efficient (float32) kernels;"
            f" the attention inputs are {dtype}. Use a supported precision, or cp_style='ulysses'."
        )
    raise RuntimeError(
        f"cp_style='ring' has no attention kernel for device {device_type!r} (CPU and CUDA only); use"
        " cp_style='ulysses'."
    )


@contextlib.contextmanager
def _options(dtype: torch.dtype, causal: bool) -> Iterator[Any]:
    """torch's ring options for one call, restored after it: partial results merged in float32 for half precision
    only (float64 stays float64), and the load-balanced causal blocks exactly when the mask is causal (torch's ring
    refuses load balancing without one; without a mask every block is whole and the order does not matter)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    options = ring._cp_options
    saved = (options.convert_to_f32, options.enable_load_balance)
    options.convert_to_f32 = dtype in (torch.float16, torch.bfloat16)
    options.enable_load_balance = causal
    try:
        yield ring
    finally:
        options.convert_to_f32, options.enable_load_balance = saved


class _RingSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: Any, is_causal: bool, scale: Any) -> Tensor:
        kernel = ring_kernel(q.device.type, q.dtype)
        with _options(q.dtype, is_causal) as ring:
            out, lse, *rest = ring._templated_ring_attention(
                group, 2, kernel.forward, q, k, v, is_causal=is_causal, **kernel.forward_kwargs(scale)
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (group, is_causal, scale, kernel, tuple(rest))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        group, is_causal, scale, kernel, rest = ctx.ring
        with _options(q.dtype, is_causal) as ring:
            dq, dk, dv, *_ = ring._templated_ring_attention_backward(
                group,
                2,
                kernel.backward,
                grad_out=grad_out.contiguous(),
                grad_out_name=kernel.grad_out_name,
                query=q,
                key=k,
                value=v,
                out=out,
                logsumexp=lse,
                is_causal=is_causal,
                **kernel.backward_kwargs(scale, rest),
            )
        return dq, dk, dv, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: Any, is_causal: bool, scale: Any = None) -> Tensor:
    """Attention of this rank's queries over the whole sequence, through torch's ring: q, k, v ``[B, H, S/cp, D]``
    (equal heads), this rank's head and tail chunks (:func:`~lightning_dist.rules.cp_chunks`) along dim 2."""
    check_torch_ring_attention()
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _RingSDPA.apply(q, k, v, group, is_causal, scale)


__all__ = ["RingKernel", "ring_attention", "ring_kernel"]
