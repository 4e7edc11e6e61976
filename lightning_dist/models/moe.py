"""A mixture-of-experts GPT: the pack's :class:`~lightning_dist.models.gpt.GPT` with expert feed-forward layers.

Notes: docs/internals.md, "lightning_dist/models/moe.py"."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist._compat import grouped_mm_refusal
from lightning_dist.models.data import CHAR_VOCAB_SIZE
from lightning_dist.models.gpt import GPT, CharGPT, GPTBlock, GPTConfig
from lightning_dist.parallelize.moe import RouterStats, balance_loss, routed, router_loss


class Experts(nn.Module):
    """`n` SwiGLU feed-forward experts of width `hidden`, as two 3-D parameters; ``forward(x, top_k_index,
    top_k_weights)`` sums each token's chosen experts' outputs, weighted (the interface of transformers' experts,
    which expert parallelism keeps: ``parallelize.ep``).

    `grouped`: run all experts as two grouped GEMMs (torch's ``grouped_mm``, as torchtitan does) or one expert at a
    time; None: grouped on CUDA where torch serves the dtype and the widths meet its 16-byte alignment, the loop
    otherwise (float64, and CPU, whose grouped GEMM is no faster)."""

    def __init__(self, *, n: int, dim: int, hidden: int, grouped: bool | None = None) -> None:
        super().__init__()
        if grouped not in (None, True, False):
            raise TypeError(f"grouped={grouped!r} must be True, False or None (grouped where torch serves it).")
        self.num_experts, self.grouped = n, grouped
        self.gate_up = nn.Parameter(torch.empty(n, 2 * hidden, dim))
        self.down = nn.Parameter(torch.empty(n, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.gate_up, self.down):
            nn.init.normal_(w, std=1 / math.sqrt(w.shape[-1]))

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert `e` on tokens `x` [N, C]."""
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[e])

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self._use_grouped(x):
            return self._grouped_forward(x, top_k_index, top_k_weights)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):  # one expert at a time: exact, and an expert may get no token at all
            rows, slot = (top_k_index == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, self.expert(e, x[rows]) * top_k_weights[rows, slot, None])
        return out

    def _use_grouped(self, x: Tensor) -> bool:
        if self.grouped is False or (self.grouped is None and x.device.type != "cuda"):
            return False  # no probe on the paths that loop anyway (every forward asks)
        widths = (x.shape[-1], self.down.shape[-1])  # the rows' strides torch's kernel needs 16-byte aligned
        aligned = all(w * x.element_size() % 16 == 0 for w in widths)
        refusal = grouped_mm_refusal(x.dtype, x.device.type) or (None if aligned else f"widths {widths} unaligned")
        if self.grouped is None:
            return refusal is None
        if refusal is not None:
            raise ValueError(
                f"Experts(grouped=True): torch's grouped GEMM does not serve {x.dtype} on {x.device.type} here"
                f" ({refusal}). Use grouped=None (the per-expert loop where it does not) or grouped=False."
            )
        return True

    def _grouped_forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """All experts in two grouped GEMMs over the (token, choice) rows sorted by expert."""
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)
        rows = order // top_k_index.shape[-1]
        ends = torch.cumsum(torch.bincount(experts, minlength=self.num_experts), 0).to(torch.int32)
        gate, up = F.grouped_mm(x[rows], self.gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=ends)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, rows, y * weights)


class SwiGLU(nn.Module):
    """A SwiGLU feed-forward of width `hidden` (the shared experts: every token goes through it)."""

    def __init__(self, *, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE(nn.Module):
    """Routed experts plus optional shared ones: ``y = sum_k w_k * expert_k(x) + shared(x)`` per token.

    Args:
        dim: model width. n_experts, top_k: experts and how many each token uses. hidden: each expert's width.
        n_shared: shared experts every token goes through (their width ``n_shared * hidden``).
        grouped: :class:`Experts`' ``grouped`` (None: grouped GEMMs where torch serves them on CUDA).
        router: ``"softmax"`` (weights: the chosen experts' softmax probabilities, renormalized) or ``"sigmoid"``
            (DeepSeek-V3: sigmoid scores, the chosen ones normalized to sum to one).
    """

    def __init__(
        self,
        *,
        dim: int,
        n_experts: int,
        top_k: int,
        hidden: int,
        n_shared: int = 0,
        router: Literal["softmax", "sigmoid"] = "softmax",
        grouped: bool | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}.")
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"router={router!r} must be 'softmax' or 'sigmoid'.")
        self.n_experts, self.top_k, self.router_kind = n_experts, top_k, router
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n=n_experts, dim=dim, hidden=hidden, grouped=grouped)
        self.shared = SwiGLU(dim=dim, hidden=n_shared * hidden) if n_shared else None
        self.register_buffer("select_bias", torch.zeros(n_experts), persistent=True)
        """Added to the scores to choose the experts, not to weigh them (DeepSeek-V3's balancing bias; zero)."""
        self.stats: RouterStats | None = None
        """This forward's routing statistics (the load-balancing loss is computed from them)."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.select_bias.zero_()  # after meta-device materialization too (to_empty leaves it unset)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(chosen experts [N, k], their weights [N, k], per-expert probabilities [N, E]) of tokens `x` [N, C]."""
        logits = self.router(x)
        scores = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        chosen = (scores + self.select_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        return chosen, weights, probs

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, probs = self.route(x)
        self.stats = RouterStats.of(chosen, probs, self.n_experts)
        out = self.experts(x, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return routed(self, out.reshape(shape), self.stats)  # under a pipeline, the router loss joins its backward


class MoEBlock(GPTBlock):
    """:class:`GPTBlock` whose feed-forward is a :class:`MoE` (``mlp``)."""

    def __init__(self, *, dim: int, n_heads: int, moe: dict, bias: bool = True, n_kv_heads: int | None = None) -> None:
        super().__init__(dim=dim, n_heads=n_heads, bias=bias, n_kv_heads=n_kv_heads)
        self.mlp = MoE(dim=dim, **moe)


class MoEGPT(GPT):
    """:class:`GPT` whose blocks are :class:`MoEBlock`; :meth:`aux_loss` is the router load-balancing loss.

    Args:
        n_experts, top_k, expert_hidden, n_shared, router: each block's :class:`MoE` (``hidden=expert_hidden``).
        grouped_experts: the experts' ``grouped`` (:class:`Experts`; None: grouped GEMMs where torch serves them on
            CUDA, one expert at a time otherwise).
        **gpt: :class:`GPT`'s sizes (``vocab_size``, ``block_size``, ``n_layer``, ``n_head``, ``n_embd``...).
    """

    def __init__(
        self,
        *,
        n_experts: int = 8,
        top_k: int = 2,
        expert_hidden: int = 32,
        n_shared: int = 0,
        router: Literal["softmax", "sigmoid"] = "softmax",
        grouped_experts: bool | None = None,
        **gpt,
    ) -> None:
        # read by make_block while GPT.__init__ builds the blocks (before nn.Module attributes can be set)
        moe = dict(n_experts=n_experts, top_k=top_k, hidden=expert_hidden, n_shared=n_shared, router=router)
        object.__setattr__(self, "_moe", {**moe, "grouped": grouped_experts})
        super().__init__(**gpt)

    def make_block(self, cfg: GPTConfig) -> nn.Module:
        return MoEBlock(dim=cfg.n_embd, n_heads=cfg.n_head, moe=self._moe, bias=cfg.bias, n_kv_heads=cfg.n_kv_head)

    @router_loss
    def aux_loss(self) -> Tensor:
        """The router load-balancing loss of the last forward, summed over the layers (each layer's on the global
        batch when a strategy runs the step: :func:`~lightning_dist.parallelize.moe.balance_loss`; a pipeline
        answers it: :class:`~lightning_dist.parallelize.moe.StagedRouterLoss`)."""
        if len(self.blocks) != self.config.n_layer:
            raise RuntimeError(
                f"MoEGPT.aux_loss() on a pipeline stage: it holds {len(self.blocks)} of the"
                f" {self.config.n_layer} blocks, and a loss from its own routers only would leave out the other"
                " stages'. Call it on the network inside training_step under PipelineStrategy, which answers it with"
                " the loss of the global batch."
            )
        layers = [b.mlp.stats for b in self.blocks if b.mlp.stats is not None]
        return sum((balance_loss(s) for s in layers), torch.zeros((), device=self.lm_head.weight.device))


class CharMoEGPT(CharGPT):
    """Character-level language modelling with :class:`MoEGPT` (kept as ``self.model``): :class:`CharGPT`'s
    cross-entropy plus ``aux_loss_coef`` times the router load-balancing loss, over the global batch under the
    pack's strategies (a pipeline's too). Logs ``train_loss`` (the sum) and ``aux_loss`` with ``sync_dist=True``.

    Args:
        n_experts, top_k, expert_hidden, n_shared, router: :class:`MoEGPT`'s experts.
        aux_loss_coef: weight of the router loss; 0 leaves it out.
        vocab_size, block_size, n_layer, n_head, n_embd, bias, n_kv_head, lr, weight_decay: as :class:`CharGPT`.
    """

    def __init__(
        self,
        *,
        n_experts: int = 8,
        top_k: int = 2,
        expert_hidden: int = 32,
        n_shared: int = 0,
        router: Literal["softmax", "sigmoid"] = "softmax",
        aux_loss_coef: float = 0.01,
        vocab_size: int = CHAR_VOCAB_SIZE,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        bias: bool = True,
        n_kv_head: int | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        # CharGPT's steps with another network: its __init__ (which builds a dense GPT) is not run
        LightningModule.__init__(self)
        self.save_hyperparameters()
        self.model = MoEGPT(
            n_experts=n_experts,
            top_k=top_k,
            expert_hidden=expert_hidden,
            n_shared=n_shared,
            router=router,
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            bias=bias,
            n_kv_head=n_kv_head,
        )
        self.lr, self.weight_decay, self.aux_loss_coef = lr, weight_decay, aux_loss_coef

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, target = batch
        loss = self.pipeline_loss(self(idx), target)
        if self.aux_loss_coef:
            aux = self.model.aux_loss()
            self.log("aux_loss", aux, sync_dist=True)
            loss = loss + self.aux_loss_coef * aux
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss


__all__ = ["CharMoEGPT", "Experts", "MoE", "MoEBlock", "MoEGPT", "SwiGLU"]
