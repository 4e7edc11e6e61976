"""The example models and data (lightning_dist.models): fast, one process."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
from lightning_dist.models.gpt import GPT, CharGPT, GPTBlock, GPTConfig
from lightning_dist.models.layers import Attention
from lightning_dist.models.vision import PatchEmbed, ShapesClassifier, ShapesCNN, ViT, ViTBlock

MODELS = {
    "cnn": (lambda: ShapesCNN(), lambda g: torch.randn(4, 1, 32, 32, generator=g), (4, 3)),
    "vit": (lambda: ViT(), lambda g: torch.randn(4, 1, 32, 32, generator=g), (4, 3)),
    "gpt": (lambda: GPT(), lambda g: torch.randint(CHAR_VOCAB_SIZE, (4, 16), generator=g), (4, 16, CHAR_VOCAB_SIZE)),
}


def _loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten()) if name == "gpt" else F.cross_entropy(out, target)


# data -------------------------------------------------------------------------------------------------


def test_shapes_data_shape_labels_and_determinism():
    x, y = make_shapes(30, image_size=24, seed=3)
    assert x.shape == (30, 1, 24, 24) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.bincount().tolist() == [10, 10, 10]
    x2, y2 = make_shapes(30, image_size=24, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(make_shapes(30, image_size=24, seed=4)[0], x)
    # the classes differ in the images, not only in the labels: a disk covers more pixels than a triangle
    clean, labels = make_shapes(300, seed=0, noise=0.0)
    area = (clean > 0).flatten(1).float().sum(1)
    assert area[labels == 0].mean() > area[labels == 1].mean() > area[labels == 2].mean()


def test_shapes_datamodule_batches():
    dm = ShapesDataModule(n_train=70, n_val=20, image_size=16, batch_size=8, seed=1)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 70 // 8  # drop_last: every training batch is full
    x, y = batches[0]
    assert x.shape == (8, 1, 16, 16) and y.shape == (8,)
    assert sum(len(b[1]) for b in dm.val_dataloader()) == 20
    # validation uses another seed than training
    assert not torch.equal(dm.val_set.tensors[0][:8], dm.train_set.tensors[0][:8])


def test_corpus_and_char_datamodule():
    text = make_corpus(5000, seed=0)
    assert len(text) == 5000 and set(text) <= set(CHAR_VOCAB)
    assert text == make_corpus(5000, seed=0) and text != make_corpus(5000, seed=1)
    assert decode(encode(text[:200])) == text[:200]
    dm = CharDataModule(n_chars=5000, block_size=16, batch_size=4, val_fraction=0.2)
    dm.setup("fit")
    idx, tgt = next(iter(dm.train_dataloader()))
    assert idx.shape == tgt.shape == (4, 16) and idx.dtype == torch.int64
    assert torch.equal(idx[:, 1:], tgt[:, :-1])  # targets are the inputs shifted by one
    assert len(dm.val_set) == (1000 - 17) // 16 + 1


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ShapesDataModule(n_train=0), "n_train=0"),
        (lambda: make_shapes(4, image_size=4), "image_size=4"),
        (lambda: CharDataModule(n_chars=100, block_size=64), "n_chars=100"),
        (lambda: CharDataModule(val_fraction=1.5), "val_fraction=1.5"),
        (lambda: encode("Hello"), "'H'"),
        (lambda: GPTConfig(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
        (lambda: GPT(n_layer=0), "n_layer=0"),
        (lambda: ViT(image_size=30, patch_size=8), "image_size=30 must be divisible by patch_size=8"),
        (lambda: ViT(dim=30, n_heads=4), "dim=30 must be a positive multiple of n_heads=4"),
        (lambda: ShapesCNN(width=0), "width=0"),
    ],
)
def test_bad_sizes_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_classifier_rejects_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module, got int"):
        ShapesClassifier(model=3)


def test_gpt_rejects_too_long_sequence():
    with pytest.raises(ValueError, match="exceeds block_size=8"):
        GPT(block_size=8)(torch.zeros(1, 9, dtype=torch.long))


# models -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_shape_and_float64(name):
    build, make_input, out_shape = MODELS[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build().eval()
    x = make_input(g)
    out32 = model(x)
    assert out32.shape == out_shape and out32.dtype == torch.float32
    model64 = copy.deepcopy(model).double()  # what precision="64-true" does
    out64 = model64(x.double() if x.is_floating_point() else x)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64.float(), out32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_decreases_with_adamw(name):
    build, make_input, out_shape = MODELS[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build()
    x = make_input(g)
    target = torch.randint(out_shape[-1], out_shape[:-1], generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = _loss(name, model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("name", list(MODELS))
def test_meta_init_then_reset_parameters_matches_direct_build(name):
    build, make_input, _ = MODELS[name]
    torch.manual_seed(7)
    direct = build()
    with torch.device("meta"):
        meta = build()
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    # the generic materialization loop a strategy runs: reset_parameters on every submodule
    for module in meta.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (key, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), key
    out = meta.eval()(make_input(torch.Generator().manual_seed(0)))
    assert torch.isfinite(out).all()


def test_lightning_materialization_of_meta_module_matches_direct_build(recwarn):
    # what the pack's strategies run after sharding a module built under `trainer.init_module(empty_init=True)`
    from lightning.fabric.utilities.init import _materialize_distributed_module

    for build in (lambda: ShapesClassifier(model=ViT()), lambda: ShapesClassifier(), lambda: CharGPT()):
        torch.manual_seed(3)
        direct = build()
        with torch.device("meta"):
            meta = build()
        torch.manual_seed(3)
        _materialize_distributed_module(meta, torch.device("cpu"))
        for (key, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
            assert torch.equal(a, b), key
    assert not [w for w in recwarn if "initialization incomplete" in str(w.message)]


def test_custom_parameters_have_an_owner_with_reset_parameters():
    # every parameter is owned (directly) by a module that can re-initialize it
    for model in (ShapesCNN(), ViT(), GPT()):
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                assert hasattr(module, "reset_parameters"), type(module).__name__
    assert isinstance(ViT().embed, PatchEmbed)


def test_model_layout_for_parallel_plans():
    vit, gpt, cnn = ViT(depth=3), GPT(n_layer=3), ShapesCNN(n_blocks=3)
    assert [type(b) for b in vit.blocks] == [ViTBlock] * 3 and [type(b) for b in gpt.blocks] == [GPTBlock] * 3
    assert isinstance(cnn.blocks, nn.ModuleList) and len(cnn.blocks) == 3
    names = {n for n, _ in gpt.named_modules()}
    for leaf in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc1", "mlp.fc2", "norm1", "norm2"):
        assert f"blocks.0.{leaf}" in names
    assert {"tok_emb", "pos_emb", "norm", "lm_head"} <= names and {"embed", "norm", "head"} <= {
        n for n, _ in vit.named_modules()
    }
    assert gpt.lm_head.weight is not gpt.tok_emb.weight  # untied by default: stages can be split
    tied = GPT(tie_weights=True)
    assert tied.lm_head.weight is tied.tok_emb.weight


@pytest.mark.parametrize("blank", [False, True], ids=["slice", "blank"])
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_style_split_composes_to_full_model(name, blank):
    # stages made by dropping the stem / head (set to None) and slicing `blocks` (or setting the blocks a
    # stage does not own to None, which keeps parameter names) reproduce the full forward
    build, make_input, _ = MODELS[name]
    torch.manual_seed(0)
    full = build().eval()
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    n = len(full.blocks)
    if blank:
        for i in range(n):
            if i < n // 2:
                last.blocks[i] = None
            else:
                first.blocks[i] = None
    else:
        first.blocks, last.blocks = first.blocks[: n // 2], last.blocks[n // 2 :]
    head_names = {"cnn": ["head"], "vit": ["norm", "pool", "head"], "gpt": ["norm", "lm_head"]}[name]
    stem_names = {"cnn": ["stem"], "vit": ["embed"], "gpt": ["tok_emb", "pos_emb"]}[name]
    for attr in head_names:
        setattr(first, attr, None)
    for attr in stem_names:
        setattr(last, attr, None)
    x = make_input(torch.Generator().manual_seed(1))
    torch.testing.assert_close(last(first(x)), full(x))
    if blank:  # the two stages' parameter names partition the full model's
        keys = [set(m.state_dict()) for m in (first, last)]
        assert keys[0].isdisjoint(keys[1]) and keys[0] | keys[1] == set(full.state_dict())


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_equals_children_in_registration_order(name):
    # the convention pipeline stages rely on: stem children, each block, head children, in order
    build, make_input, _ = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    x = make_input(torch.Generator().manual_seed(2))
    y = x
    for child in model.children():
        for part in child if isinstance(child, nn.ModuleList) else [child]:
            y = part(y)
    torch.testing.assert_close(y, model(x))


def _shard_attention(attn: Attention, rank: int, world: int) -> Attention:
    """Rank `rank` of a `world`-way column (q, k, v) / row (proj) split, built by hand in one process."""
    dim = attn.q.in_features
    cols = slice(rank * dim // world, (rank + 1) * dim // world)
    shard = copy.deepcopy(attn)
    for name in ("q", "k", "v"):
        full = getattr(attn, name)
        part = nn.Linear(dim, dim // world)
        part.weight.data, part.bias.data = full.weight.data[cols].clone(), full.bias.data[cols].clone()
        setattr(shard, name, part)
    proj = nn.Linear(dim // world, dim, bias=rank == 0)  # the row-wise output bias is added once
    proj.weight.data = attn.proj.weight.data[:, cols].clone()
    if rank == 0:
        proj.bias.data = attn.proj.bias.data.clone()
    shard.proj = proj
    return shard


@pytest.mark.parametrize("block_cls", [ViTBlock, GPTBlock])
def test_attention_heads_follow_sharded_projection_width(block_cls):
    torch.manual_seed(0)
    attn = block_cls(dim=32, n_heads=4).attn
    x = torch.randn(2, 5, 32)
    expected = attn(x)
    partial = [_shard_attention(attn, r, 2)(x) for r in range(2)]
    assert partial[0].shape == expected.shape
    torch.testing.assert_close(partial[0] + partial[1], expected)  # the all-reduce of row-wise proj


# LightningModules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "data"),
    [
        (
            lambda: ShapesClassifier(model=ViT(image_size=16, patch_size=4)),
            lambda: ShapesDataModule(n_train=64, n_val=16, image_size=16, batch_size=16),
        ),
        (
            lambda: ShapesClassifier(model=ShapesCNN(width=8, n_blocks=1)),
            lambda: ShapesDataModule(n_train=64, n_val=16, image_size=16, batch_size=16),
        ),
        (lambda: CharGPT(n_embd=32, block_size=16), lambda: CharDataModule(n_chars=4000, block_size=16, batch_size=8)),
    ],
    ids=["vit", "cnn", "gpt"],
)
def test_lightning_module_fits_in_float64(module, data, tmp_path):
    L.seed_everything(0, verbose=False)
    lm = module()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=3,
        limit_val_batches=1,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lm, datamodule=data())
    metrics = trainer.callback_metrics
    expected = {"train_loss", "val_loss"} | ({"val_acc"} if isinstance(lm, ShapesClassifier) else set())
    assert expected <= metrics.keys()
    assert metrics["train_loss"].dtype == torch.float64 and torch.isfinite(metrics["val_loss"])
    assert all(p.dtype == torch.float64 for p in lm.parameters())
    assert trainer.global_step == 3
    assert isinstance(lm.configure_optimizers(), torch.optim.AdamW)


def test_generate_shape():
    torch.manual_seed(0)
    lm = CharGPT(block_size=8, n_embd=16, n_head=2).eval()
    out = lm.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=10)
    assert out.shape == (2, 13) and int(out.max()) < CHAR_VOCAB_SIZE
