"""Example vision models (a BatchNorm CNN and a small ViT) and their LightningModule.

Notes: docs/internals.md, "lightning_dist/models/vision.py"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override

from lightning_dist.models.layers import TransformerBlock, deferred_init


def _check_positive(**values: int) -> None:
    bad = [f"{name}={value!r}" for name, value in values.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"Expected positive integers, got {', '.join(bad)}. Pass values >= 1.")


class ConvBlock(nn.Module):
    """Residual block ``relu(x + bn(conv(relu(bn(conv(x))))))``; keeps the shape ``[B, C, H, W]``."""

    def __init__(self, *, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ShapesCNN(nn.Module):
    """Small residual CNN with BatchNorm: ``stem`` (conv, BN, ReLU, 2x2 max-pool), ``blocks``, ``head`` (global
    max-pool, linear).

    Args:
        in_channels: Image channels.
        width: Channels of every block.
        n_blocks: Number of :class:`ConvBlock` in ``blocks``.
        num_classes: Output logits.
    """

    def __init__(self, *, in_channels: int = 1, width: int = 16, n_blocks: int = 2, num_classes: int = 3) -> None:
        super().__init__()
        _check_positive(in_channels=in_channels, width=width, n_blocks=n_blocks, num_classes=num_classes)
        with deferred_init(self):
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.blocks = nn.ModuleList(ConvBlock(channels=width) for _ in range(n_blocks))
            # global max-pool: 'is this corner/edge present' features; an average-pooled head drifted with BatchNorm's
            # running stats
            self.head = nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks:
            if block is not None:  # a pipeline stage may blank out blocks it does not own
                x = block(x)
        return self.head(x) if self.head is not None else x


class PatchEmbed(nn.Module):
    """Patch embedding (strided conv) plus class token and learned position embedding -> ``[B, 1 + P, dim]``."""

    def __init__(self, *, image_size: int, patch_size: int, in_channels: int, dim: int) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be divisible by patch_size={patch_size}.")
        n_patches = (image_size // patch_size) ** 2
        self.image_size = image_size  # what a made-up probe image needs (the strategies' setup self-checks)
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, n_patches + 1, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize this module's own parameters (``proj`` has its own ``reset_parameters``)."""
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)  # [B, P, dim]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed


class ClsPool(nn.Module):
    """Select the class-token position: ``[B, 1 + P, dim] -> [B, dim]`` (no parameters)."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, 0]


class ViTBlock(TransformerBlock):
    """Pre-norm ViT block: ``norm1``, ``attn`` (``q``, ``k``, ``v``, ``proj``), ``norm2``, ``mlp`` (``fc1``,
    ``fc2``)."""

    causal = False


class ViT(nn.Module):
    """Small Vision Transformer: ``embed`` (:class:`PatchEmbed`), ``blocks`` of :class:`ViTBlock`, ``norm``,
    ``pool`` (:class:`ClsPool`), ``head``; ``forward`` applies these children in that order. Sizes are keyword-only;
    defaults suit 32x32 grayscale shapes.

    Args:
        image_size: Input height and width.
        patch_size: Side of a square patch; must divide ``image_size``.
        in_channels: Image channels.
        dim: Embedding width; must be divisible by ``n_heads``.
        depth: Number of blocks.
        n_heads: Attention heads.
        mlp_ratio: MLP hidden width = ``mlp_ratio * dim``.
        num_classes: Output logits.
    """

    def __init__(
        self,
        *,
        image_size: int = 32,
        patch_size: int = 8,
        in_channels: int = 1,
        dim: int = 32,
        depth: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        num_classes: int = 3,
    ) -> None:
        super().__init__()
        _check_positive(
            image_size=image_size,
            patch_size=patch_size,
            in_channels=in_channels,
            dim=dim,
            depth=depth,
            n_heads=n_heads,
            mlp_ratio=mlp_ratio,
            num_classes=num_classes,
        )
        with deferred_init(self):
            self.embed = PatchEmbed(image_size=image_size, patch_size=patch_size, in_channels=in_channels, dim=dim)
            self.blocks = nn.ModuleList(ViTBlock(dim=dim, n_heads=n_heads, mlp_ratio=mlp_ratio) for _ in range(depth))
            self.norm = nn.LayerNorm(dim)
            self.pool = ClsPool()
            self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            if block is not None:  # a pipeline stage may blank out blocks it does not own
                x = block(x)
        for part in (self.norm, self.pool, self.head):
            if part is not None:
                x = part(x)
        return x


class ShapesClassifier(LightningModule):
    """Image classification LightningModule around any ``nn.Module`` mapping images to logits.

    Logs ``train_loss`` (progress bar), ``val_loss`` and ``val_acc`` (progress bar), all with
    ``sync_dist=True`` so distributed strategies reduce them over the data-parallel ranks.

    Args:
        model: The network, kept as ``self.model``; default :class:`ShapesCNN` with its defaults.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
    """

    def __init__(self, *, model: nn.Module | None = None, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.save_hyperparameters(ignore=["model"])
        self.model = model if model is not None else ShapesCNN()
        self.lr, self.weight_decay = lr, weight_decay

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Loss from the network output (logits) and the labels; also what a pipeline's last stage calls."""
        return F.cross_entropy(output, target)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(-1) == y).to(logits.dtype).mean()
        self.log("val_loss", self.pipeline_loss(logits, y), sync_dist=True)
        self.log("val_acc", acc, prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", self.pipeline_loss(logits, y), sync_dist=True)
        self.log("test_acc", (logits.argmax(-1) == y).to(logits.dtype).mean(), sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
