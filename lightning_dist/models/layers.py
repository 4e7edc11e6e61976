"""Transformer layers shared by the example ViT and GPT.

Naming is the contract the pack's tensor-parallel plans rely on: a block has ``norm1``, ``attn`` (with
separate ``q``, ``k``, ``v`` and ``proj`` linears), ``norm2`` and ``mlp`` (``fc1``, ``fc2``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check_heads(dim: int, n_heads: int) -> int:
    if dim < 1 or n_heads < 1 or dim % n_heads:
        raise ValueError(
            f"dim={dim} must be a positive multiple of n_heads={n_heads}; choose sizes with dim % n_heads == 0."
        )
    return dim // n_heads


class Attention(nn.Module):
    """Multi-head self-attention with separate ``q``, ``k``, ``v`` and output ``proj`` projections.

    The number of heads is read from the projection output at run time
    (``q.shape[-1] // head_dim``), so column-wise tensor-parallel sharding of ``q``/``k``/``v`` (and
    row-wise of ``proj``) needs no code change: each rank simply runs its local heads.

    Args:
        dim: Model width.
        n_heads: Number of heads before any sharding; ``dim`` must be divisible by it.
        causal: Mask future positions (decoder).
        bias: Whether the linears have a bias.
        n_kv_heads: key/value heads (grouped-query attention, as Llama 3); None: ``n_heads``. Must divide
            ``n_heads``; each key/value head serves ``n_heads / n_kv_heads`` query heads.
    """

    def __init__(
        self, *, dim: int, n_heads: int, causal: bool = False, bias: bool = True, n_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.head_dim = _check_heads(dim, n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads} (grouped-query attention).")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.causal = causal
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        # local heads from the (possibly tensor-parallel sharded) width, not from self.n_heads
        n_local, n_local_kv = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q, k, v = (
            t.unflatten(-1, (t.shape[-1] // self.head_dim, self.head_dim)).transpose(1, 2) for t in (q, k, v)
        )  # [B, H, T, D]
        if n_local_kv != n_local:  # grouped-query attention: each key/value head serves a group of query heads
            k, v = (t.repeat_interleave(n_local // n_local_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """Two-layer feed-forward ``fc1 -> GELU -> fc2`` (column- then row-wise under tensor parallelism)."""

    def __init__(self, *, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    causal: bool = False

    def __init__(
        self, *, dim: int, n_heads: int, mlp_ratio: int = 4, bias: bool = True, n_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim=dim, n_heads=n_heads, causal=self.causal, bias=bias, n_kv_heads=n_kv_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim=dim, hidden=mlp_ratio * dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def init_weights(module: nn.Module) -> nn.Module:
    """Call ``reset_parameters()`` on every submodule that has one, in ``module.modules()`` order.

    Each module of the example models initializes only its own direct parameters and buffers, so this
    is the whole initialization. It is what materializes a model built on the meta device
    (``model.to_empty(device=...)`` then ``init_weights(model)``), and what the example models'
    constructors run, so both paths give identical weights from the same RNG state.
    """
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return module


@contextmanager
def deferred_init(module: nn.Module) -> Iterator[None]:
    """Build ``module``'s children on the meta device, then materialize them with :func:`init_weights`.

    Used in the example models' ``__init__``: the weights depend only on the RNG state at the end of
    construction, exactly as after meta-device init + ``to_empty`` + ``init_weights``. Under an outer
    ``torch.device("meta")`` context the model stays on meta.
    """
    device = torch.get_default_device()
    with torch.device("meta"):
        yield
    if device.type != "meta":
        module.to_empty(device=device)
        init_weights(module)
