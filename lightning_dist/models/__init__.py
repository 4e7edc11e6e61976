"""Example models and in-process data for the pack's examples, tests and benchmarks.

Every network is ``stem -> blocks (nn.ModuleList) -> head``; transformer blocks name their layers
``norm1``, ``attn.{q,k,v,proj}``, ``norm2``, ``mlp.{fc1,fc2}``.
"""

from lightning_dist.models.data import (
    CHAR_VOCAB,
    CHAR_VOCAB_SIZE,
    CharDataModule,
    ShapesDataModule,
    decode,
    encode,
    make_corpus,
    make_shapes,
)
from lightning_dist.models.gpt import GPT, CharGPT, GPTBlock, GPTConfig, PositionEmbedding
from lightning_dist.models.layers import MLP, Attention, TransformerBlock, init_weights
from lightning_dist.models.moe import CharMoEGPT, MoE, MoEBlock, MoEGPT
from lightning_dist.models.vision import ClsPool, ConvBlock, PatchEmbed, ShapesClassifier, ShapesCNN, ViT, ViTBlock

__all__ = [
    "CHAR_VOCAB",
    "CHAR_VOCAB_SIZE",
    "MLP",
    "GPT",
    "MoE",
    "MoEBlock",
    "MoEGPT",
    "Attention",
    "CharDataModule",
    "CharGPT",
    "CharMoEGPT",
    "ClsPool",
    "ConvBlock",
    "GPTBlock",
    "GPTConfig",
    "PatchEmbed",
    "PositionEmbedding",
    "ShapesCNN",
    "ShapesClassifier",
    "ShapesDataModule",
    "TransformerBlock",
    "ViT",
    "ViTBlock",
    "decode",
    "encode",
    "init_weights",
    "make_corpus",
    "make_shapes",
]
