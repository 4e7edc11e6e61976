"""Tensor-parallel parity with single-device training (torchrun, 2 or 4 processes; float64, 3 AdamW steps).

2 processes: tp=2 for the example GPT and ViT (sequence parallelism off and on) and a plain MLP; the
GPT checkpoint (sharded DCP dir) reloads on tp=1 (dp_shard=2) and, consolidated, on one device.
4 processes: tp=2 x dp_shard=2 and tp=2 x dp_replicate=2 for the same models, and the GPT with
sequence parallelism, activation checkpointing and ZeRO-2 together. Both: the GPT with ``loss_parallel=True``
(logits kept vocabulary-sharded; 2 processes: a softmax loss it cannot serve is refused at the first step).
Without a common seed (eager or meta-device init) every rank must start from one model.
Every run also logs the number of samples with reduce_fx="sum": it must equal the global batch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist._compat import TP_SEQUENCE_PARALLEL_WITH_DP_HANGS
from lightning_dist.models import GPT, ViT
from lightning_dist.strategies import TensorParallelStrategy

STEPS, GLOBAL_BATCH, N = 3, 8, 48
SEQ = 8  # GPT tokens; the ViT has 16/8 -> 4 patches + class token = 5 tokens (uneven over tp=2)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # identical initial weights on every rank and in the reference (unless told otherwise)
    if kind in ("gpt", "vit"):
        if kind == "gpt":
            model = GPT(vocab_size=32, block_size=SEQ, n_layer=2, n_head=4, n_embd=16, mlp_ratio=2)
        else:
            model = ViT(image_size=16, patch_size=8, dim=16, depth=2, n_heads=4, mlp_ratio=2, num_classes=4)
        for block in model.blocks:
            # the key bias has zero gradient in exact arithmetic (softmax is shift-invariant): AdamW would
            # turn its rounding noise (~1e-17) into lr-sized steps, on the reference and TP runs alike
            block.attn.k.bias.requires_grad_(False)
        return model
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 6)
    )


def data(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        return TensorDataset(torch.randint(0, 32, (N, SEQ), generator=g), torch.randint(0, 32, (N, SEQ), generator=g))
    if kind == "vit":
        return TensorDataset(
            torch.randn(N, 1, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 4, (N,), generator=g)
        )
    return TensorDataset(torch.randn(N, 12, generator=g, dtype=torch.float64), torch.randint(0, 6, (N,), generator=g))


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


class Task(pl.LightningModule):
    def __init__(self, kind: str, seed: int = 0, meta: bool = False) -> None:
        super().__init__()
        self.kind, self.meta = kind, meta
        self.model = None if meta else build(kind, seed)

    def configure_model(self):
        if self.model is None:  # under the strategy's init context: the meta device
            self.model = build(self.kind)
            torch.manual_seed(2000 + dist.get_rank())  # no common RNG state when the weights are materialized

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.model(x), y)
        # summed over the data-parallel ranks only: must log the global batch, not tp times it
        self.log("samples", torch.tensor(float(len(x)), dtype=torch.float64), reduce_fx="sum", sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(data(self.kind), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)


def reference(kind: str, seed: int = 0) -> dict:
    model = build(kind, seed).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data(kind)
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def fit(kind: str, task: Task | None = None, **options) -> tuple[Task, pl.Trainer]:
    task = task or Task(kind)
    t = trainer(TensorParallelStrategy(**options), devices=dist_world(), steps=STEPS)
    t.fit(task)
    return task, t


def dist_world() -> int:
    return int(os.environ["WORLD_SIZE"])


def check(kind: str, refs: dict, **options) -> None:
    task = Task(kind)
    heads = []  # the GPT head's output in training (after the TP style's hooks): its type and this rank's shape
    if kind == "gpt":
        task.on_train_start = lambda: task.model.lm_head.register_forward_hook(
            lambda m, args, out: heads.append(
                [type(out).__name__, list(out.to_local().shape if hasattr(out, "to_local") else out.shape)]
            )
        )
    task, t = fit(kind, task, **options)
    diff = max_rel_diff(full_params(task), refs[kind])
    emit(
        kind="parity",
        model=kind,
        options=options,
        diff=diff,
        samples=float(t.callback_metrics["samples"]),
        mesh=list(t.strategy.mesh.spec.shape),
        n_tp_entries=len(t.strategy.tp_entries),
        probe_diff=t.strategy.tp_probe_diff,
        head_output=heads[-1] if heads else None,
    )


world = dist_world()
kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gpt", "vit", "mlp"]
refs = {k: reference(k) for k in kinds}
meshes = (
    [{"tp": 2}]
    if world == 2
    else [{"tp": 2, "dp_shard": 2, "dp_replicate": 1}, {"tp": 2, "dp_replicate": 2, "dp_shard": 1}]
)


def refused(kind: str, **options) -> bool:
    """On torch < 2.13 sequence parallelism with data parallelism is refused (it deadlocks there): record it."""
    if not (TP_SEQUENCE_PARALLEL_WITH_DP_HANGS and options.get("sequence_parallel") and world == 4):
        return False
    try:
        fit(kind, **options)
    except ValueError as err:
        emit(kind="refused", model=kind, options=options, message=str(err))
        return True
    raise AssertionError(f"{kind} {options}: sequence parallelism with dp was not refused on this torch")


for mesh in meshes:
    for kind in kinds:
        for sp in (False,) if kind == "mlp" else (False, True):
            if not refused(kind, sequence_parallel=sp, **mesh):
                check(kind, refs, sequence_parallel=sp, **mesh)
if "gpt" in kinds:
    # loss_parallel=True: the head's logits stay sharded on the vocabulary (each rank holds [B, T, V / tp]) and the
    # cross-entropy runs in torch's loss_parallel; the same update as one device
    for sp in (False, True) if world == 2 or not TP_SEQUENCE_PARALLEL_WITH_DP_HANGS else (False,):
        check("gpt", refs, sequence_parallel=sp, loss_parallel=True, **meshes[0])


class SoftmaxLoss(Task):
    def training_step(self, batch, batch_idx):
        x, y = batch
        probs = self.model(x).softmax(-1)  # not cross-entropy on the logits: loss_parallel cannot serve it
        return F.nll_loss(probs.log().flatten(0, 1), y.flatten())


if world == 2 and "gpt" in kinds:
    # a loss loss_parallel cannot serve: refused at the first step on every rank, naming the call and the fix
    try:
        fit("gpt", SoftmaxLoss("gpt"), tp=2, loss_parallel=True)
        emit(kind="loss_parallel_refusal", error=None)
    except ValueError as err:
        emit(kind="loss_parallel_refusal", error=str(err))
if (
    world == 4
    and "gpt" in kinds
    and not refused("gpt", sequence_parallel=True, activation_checkpointing=True, zero_stage=2, **meshes[0])
):
    # the full order TP -> activation checkpointing -> FSDP (ZeRO-2) on one mesh
    check("gpt", refs, sequence_parallel=True, activation_checkpointing=True, zero_stage=2, **meshes[0])
if world == 4 and "gpt" in kinds:
    # selective AC keeps the DTensor matmul / attention outputs across the tp x dp mesh; every:2 the plain blocks
    check("gpt", refs, sequence_parallel=False, activation_checkpointing="selective", **meshes[0])
    check("gpt", refs, sequence_parallel=False, activation_checkpointing="every:2", **meshes[1])

if world == 2 and "gpt" in kinds:
    # checkpoint: tp=2 (sequence parallel) -> sharded dir -> tp=1 on 2 ranks, and -> one file on one device
    folder = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None
    box = [folder]
    dist.broadcast_object_list(box, 0)
    folder = box[0]
    task, t = fit("gpt", tp=2, sequence_parallel=True)
    t.save_checkpoint(folder / "tp2")
    saved = full_params(task)
    loaded = Task("gpt")
    torch.nn.init.zeros_(loaded.model.lm_head.weight)  # make sure the weights really come from the file
    t1 = trainer(TensorParallelStrategy(tp=1, dp_shard=2), devices=2, steps=STEPS)
    t1.fit(loaded, ckpt_path=folder / "tp2")
    tp1_diff = max_rel_diff(full_params(loaded), saved)
    single_diff = None
    if dist.get_rank() == 0:
        from lightning_dist.checkpoint import consolidate

        consolidate(folder / "tp2", folder / "single.ckpt")
        state = torch.load(folder / "single.ckpt", weights_only=True)["state_dict"]
        single = Task("gpt").double()
        single.load_state_dict(state)
        single_diff = max_rel_diff({n: p.detach() for n, p in single.named_parameters()}, saved)
    emit(
        kind="checkpoint",
        tp1_diff=tp1_diff,
        single_diff=single_diff,
        tp1_mesh=list(t1.strategy.mesh.spec.shape),
        global_step=t1.global_step,
    )

if world == 4 and "gpt" in kinds:
    # no common seed: each rank builds its own GPT (seed 1000 + rank); tp peers and dp replicas must all start from
    # rank 0's model (sharded matrices from one model, replicated norms and row-parallel biases equal)
    task = Task("gpt", seed=1000 + dist.get_rank())
    t = trainer(TensorParallelStrategy(tp=2, dp_replicate=2, dp_shard=1), devices=4, steps=STEPS)
    t.fit(task)
    emit(kind="noseed", diff=max_rel_diff(full_params(task), reference("gpt", seed=1000)))
    # the same on the meta device, each rank with its own RNG state: every rank must hold one model
    task = Task("gpt", meta=True)
    trainer(TensorParallelStrategy(tp=2, dp_replicate=2, dp_shard=1), devices=4, steps=1).fit(task)
    # full_tensor() takes each rank's own copy of a replicated dim: differing peers would give differing digests
    emit(kind="noseed_meta", digest=[p.sum().item() for p in full_params(task).values()])
