"""A small GPT-like character-level decoder and its LightningModule.

Layout ``tok_emb`` + ``pos_emb`` (stem) -> ``blocks`` (nn.ModuleList of :class:`GPTBlock`) -> ``norm`` ->
``lm_head``. A pipeline stage may set ``tok_emb``/``pos_emb`` or ``norm``/``lm_head`` to ``None`` and slice
``blocks`` or set entries of it to ``None`` (keeps parameter names stable); ``forward`` skips what is ``None``
(first stage: token ids in; later stages: hidden states in).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist.models.data import CHAR_VOCAB_SIZE
from lightning_dist.models.layers import TransformerBlock, deferred_init


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of :class:`GPT`."""

    vocab_size: int = CHAR_VOCAB_SIZE
    """Number of token ids (the character data module's alphabet by default)."""
    block_size: int = 64
    """Longest sequence (number of learned positions)."""
    n_layer: int = 2
    """Number of blocks."""
    n_head: int = 4
    """Attention heads; must divide ``n_embd``."""
    n_embd: int = 64
    """Model width."""
    mlp_ratio: int = 4
    """MLP hidden width = ``mlp_ratio * n_embd``."""
    bias: bool = True
    """Biases in linears."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention, as Llama 3); None: ``n_head``. Must divide ``n_head``."""
    tie_weights: bool = False
    """Share ``lm_head.weight`` with ``tok_emb.weight`` (off: tied weights cannot be split across pipeline stages)."""

    def __post_init__(self) -> None:
        sizes = {k: v for k, v in asdict(self).items() if k not in ("bias", "tie_weights", "n_kv_head")}
        problems = [f"{k}={v!r} must be an integer >= 1" for k, v in sizes.items() if not isinstance(v, int) or v < 1]
        if not problems and self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if (
            not problems
            and self.n_kv_head is not None
            and (not isinstance(self.n_kv_head, int) or self.n_kv_head < 1 or self.n_head % self.n_kv_head)
        ):
            problems.append(f"n_kv_head={self.n_kv_head!r} must be an integer >= 1 dividing n_head={self.n_head}")
        if problems:
            raise ValueError("Invalid GPTConfig: " + "; ".join(problems) + ".")


class PositionEmbedding(nn.Module):
    """Learned absolute positions added to token embeddings: ``x [B, T, dim] -> x + weight[:T]``."""

    def __init__(self, *, block_size: int, dim: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.weight = nn.Parameter(torch.empty(block_size, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)  # as nn.Embedding

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is not None:  # a part of the sequence (context parallelism): the positions it holds
            return x + self.weight[position_ids]
        if x.shape[1] > self.block_size:
            raise ValueError(f"Sequence length {x.shape[1]} exceeds block_size={self.block_size}.")
        return x + self.weight[: x.shape[1]]


class GPTBlock(TransformerBlock):
    """Pre-norm causal block: ``norm1``, ``attn`` (``q``, ``k``, ``v``, ``proj``), ``norm2``, ``mlp`` (``fc1``,
    ``fc2``)."""

    causal = True


class GPT(nn.Module):
    """GPT-like decoder; ``forward(idx [B, T] int64, position_ids=None) -> logits [B, T, vocab_size]``.

    ``position_ids [B, T]`` (HF's convention): the positions of the tokens of `idx` (context parallelism passes
    those of this rank's part of each sequence); None: ``0 .. T-1``.

    Children ``tok_emb`` (nn.Embedding), ``pos_emb`` (:class:`PositionEmbedding`), ``blocks``, ``norm``,
    ``lm_head`` (nn.Linear, no bias); ``forward`` applies them in that order.

    Keyword-only sizes as in :class:`GPTConfig` (kept as ``self.config``).
    """

    def __init__(
        self,
        *,
        vocab_size: int = CHAR_VOCAB_SIZE,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        mlp_ratio: int = 4,
        bias: bool = True,
        tie_weights: bool = False,
        n_kv_head: int | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            bias=bias,
            tie_weights=tie_weights,
            n_kv_head=n_kv_head,
        )
        with deferred_init(self):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos_emb = PositionEmbedding(block_size=cfg.block_size, dim=cfg.n_embd)
            self.blocks = nn.ModuleList(self.make_block(cfg) for _ in range(cfg.n_layer))
            self.norm = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if tie_weights:
            self.tie_weights_()

    def make_block(self, cfg: GPTConfig) -> nn.Module:
        """One block (subclasses change the block type: :class:`~lightning_dist.models.moe.MoEGPT`)."""
        return GPTBlock(
            dim=cfg.n_embd, n_heads=cfg.n_head, mlp_ratio=cfg.mlp_ratio, bias=cfg.bias, n_kv_heads=cfg.n_kv_head
        )

    def tie_weights_(self) -> None:
        """Share ``lm_head.weight`` with ``tok_emb.weight``; call again after ``to_empty`` (it unties them)."""
        self.lm_head.weight = self.tok_emb.weight

    @classmethod
    def from_config(cls, config: GPTConfig) -> GPT:
        """Build from a :class:`GPTConfig`."""
        return cls(**asdict(config))

    def forward(self, idx: Tensor, position_ids: Tensor | None = None) -> Tensor:
        # a part set to None is skipped: torchtitan's way of cutting a pipeline stage by hand (benchmarks/)
        x = idx if self.tok_emb is None else self.tok_emb(idx)
        if self.pos_emb is not None:
            x = self.pos_emb(x, position_ids)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        for part in (self.norm, self.lm_head):
            if part is not None:
                x = part(x)
        return x


class CharGPT(LightningModule):
    """Character-level language modelling with :class:`GPT` (kept as ``self.model``).

    Batches are ``(idx, targets)``, both ``int64 [B, T]``. Logs ``train_loss`` (progress bar),
    ``val_loss`` (progress bar) with ``sync_dist=True``.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, mlp_ratio, bias, tie_weights, n_kv_head: :class:`GPT` sizes.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(
        self,
        *,
        vocab_size: int = CHAR_VOCAB_SIZE,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        mlp_ratio: int = 4,
        bias: bool = True,
        tie_weights: bool = False,
        n_kv_head: int | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            mlp_ratio=mlp_ratio,
            bias=bias,
            tie_weights=tie_weights,
            n_kv_head=n_kv_head,
        )
        self.lr, self.weight_decay = lr, weight_decay

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean next-token cross-entropy of logits ``[B, T, V]`` against targets ``[B, T]``."""
        return F.cross_entropy(output.flatten(0, 1), target.flatten(0, 1))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, target = batch
        loss = self.pipeline_loss(self(idx), target)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        idx, target = batch
        self.log("val_loss", self.pipeline_loss(self(idx), target), prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        idx, target = batch
        self.log("test_loss", self.pipeline_loss(self(idx), target), sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    @torch.no_grad()
    def generate(self, idx: Tensor, *, max_new_tokens: int, temperature: float = 1.0) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx [B, T]`` (single-process, unsharded model)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.model.config.block_size :])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return idx
