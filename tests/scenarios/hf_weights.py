"""HuggingFace safetensors in and out of sharded models (torchrun, 2 processes).

Rank 0 writes tiny random GPT-2 (tied head) and Llama folders with ``save_pretrained``. Each is loaded
into a model built under ``init_empty_weights`` (parameters on meta) and sharded by ``tp`` (plan="auto")
and by ``fsdp2``, through the HFPretrained callback; the loaded parameters must equal the folder's
exactly, and the export written at the end of the fit (one step at lr=0) must load with
``from_pretrained`` and equal the source exactly.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from _common import full_params, trainer
from lightning.pytorch import Callback
from safetensors.torch import load_file
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import HFPretrained
from lightning_dist.hf import init_empty_weights
from lightning_dist.strategies import FullyShardStrategy, TensorParallelStrategy

VOCAB = 64


def source(kind: str, folder: Path) -> None:
    torch.manual_seed(0)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                                 bos_token_id=0, eos_token_id=0))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(str(folder), safe_serialization=True)


class Task(pl.LightningModule):
    def __init__(self, folder: Path) -> None:
        super().__init__()
        with init_empty_weights():
            self.model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(str(folder)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the export must equal the source

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ds = TensorDataset(torch.randint(0, VOCAB, (8, 8), generator=g), torch.randint(0, VOCAB, (8, 8), generator=g))
        kw = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(ds, batch_size=4 // kw["num_replicas"] or 1, sampler=DistributedSampler(ds, shuffle=False, **kw))


class Snapshot(Callback):
    """Whole parameters right after HFPretrained loaded them (runs after it: callbacks keep their order)."""

    def on_fit_start(self, trainer, pl_module):
        self.params = full_params(pl_module)
        self.local_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pl_module.parameters())


def diff_to_source(params: dict, src: dict) -> float:
    # every stored tensor, under the name the model gives it (a tied head is stored once, as the embedding)
    out = 0.0
    for name, value in src.items():
        out = max(out, (params[f"model.{name}"].float() - value.float()).abs().max().item())
    return out


dist.init_process_group("gloo")
box = [Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
dist.broadcast_object_list(box, 0)
root = box[0]
kinds = ["gpt2", "llama"]
if dist.get_rank() == 0:
    for kind in kinds:
        source(kind, root / f"src_{kind}")
dist.barrier()
for kind in kinds:
    src = load_file(str(root / f"src_{kind}" / "model.safetensors"))
    for label, strategy in (("tp2", lambda: TensorParallelStrategy(tp=2, plan="auto")), ("fsdp2", FullyShardStrategy)):
        out = root / f"out_{kind}_{label}"
        snap = Snapshot()
        t = trainer(strategy(), devices=2, steps=1, precision="32-true",
                    callbacks=[HFPretrained(root / f"src_{kind}", export_to=out), snap])
        t.fit(Task(root / f"src_{kind}"))
        row = {"model": kind, "strategy": label, "loaded_diff": diff_to_source(snap.params, src),
               "local_numel": snap.local_numel, "total_numel": sum(v.numel() for v in snap.params.values())}
        if dist.get_rank() == 0:
            back = tf.AutoModelForCausalLM.from_pretrained(str(out))
            sd = back.state_dict()
            row["export_diff"] = max((sd[k].float() - v.float()).abs().max().item() for k, v in src.items())
            row["export_tied"] = kind != "gpt2" or back.lm_head.weight is back.transformer.wte.weight
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, {**row, "rank": dist.get_rank()})
        if dist.get_rank() == 0:
            sys.stdout.write("".join("RESULT " + json.dumps(r) + "\n" for r in rows))
            sys.stdout.flush()
dist.barrier()
if dist.get_rank() == 0:
    import shutil

    shutil.rmtree(root, ignore_errors=True)
dist.destroy_process_group()
