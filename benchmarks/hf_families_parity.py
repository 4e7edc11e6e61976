"""Which of transformers' causal LMs train exactly under a strategy: every model type, a tiny random config (dropout
0), float64, 2 AdamW steps through Lightning on 2 processes (gloo) against one device on the global batch in the same
process. A survey, not a test; docs/models.md.

    python benchmarks/hf_families_parity.py --strategy tp [--models llama,bloom] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

STEPS, BATCH, SEQ, N = 2, 4, 8, 8
EXACT = 1e-12
STRATEGIES = {  # name -> (strategy class name, its arguments)
    "tp": ("TensorParallelStrategy", dict(tp=2, tp_plan="auto")),
    "cp": ("FullyShardStrategy", dict(cp=2, dp_shard=1)),
    "fsdp": ("FullyShardStrategy", dict(dp_shard=2)),
    "ep": ("FullyShardStrategy", dict(dp_shard=2, ep=2)),
    "pp": ("PipelineStrategy", dict(pp=2, schedule="1f1b")),
    "pp_interleaved": ("PipelineStrategy", dict(pp=2, schedule="interleaved_1f1b")),
}


def _families():
    spec = importlib.util.spec_from_file_location("_families", Path(__file__).with_name("hf_pipeline_families.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(model_type: str) -> torch.nn.Module:
    """The pipeline survey's tiny config with every dropout-like probability at 0 (the runs must be deterministic)."""
    import transformers as tf

    fam = _families()
    cfg = fam.tiny_config(model_type)
    for key, value in cfg.to_dict().items():
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "drop_prob", "layerdrop", "jitter")):
            fam.set_field(cfg, key, 0.0)
    with torch.device("meta"):  # a config whose size fields are named otherwise stays large: not built
        size = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(cfg).parameters())
    if size > 20_000_000:
        raise RuntimeError(f"the tiny config still has {size:,} parameters (size fields named otherwise)")
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").double()


def data(vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 64), (N, SEQ), generator=torch.Generator().manual_seed(1))


def reference(net: torch.nn.Module, ids: torch.Tensor, noise: float = 0.0, halves: bool = False) -> dict:
    """One device on the global batch. The floors of a model with float32 parts inside against any change of summation
    order: `noise`, every Linear's output moved by that relative round-off (a split's all-reduce); `halves`, the
    gradient summed over two half-batches (data parallelism)."""
    net = copy.deepcopy(net).train()  # as Lightning trains it (from_config may hand it back in eval mode)
    gen = torch.Generator().manual_seed(2)

    def jitter(module, args, out):
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out * (1 + noise * torch.randn(out.shape, generator=gen, dtype=out.dtype))

    if noise:
        for module in net.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(jitter)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for k in range(STEPS):
        x = ids[k * BATCH : (k + 1) * BATCH]
        opt.zero_grad()
        for part in x.chunk(2) if halves else [x]:
            (net(input_ids=part, labels=part).loss / (2 if halves else 1)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def run_rank(strategy_name: str, model_types: list[str]) -> list[dict]:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler

    import lightning_dist  # noqa: F401
    import lightning_dist.strategies as strategies
    from lightning_dist.parallelize.tp.probe import probe_output

    class Task(pl.LightningModule):
        def __init__(self, net, ids):
            super().__init__()
            self.model, self.ids = net, ids

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            kw = self.trainer.strategy.distributed_sampler_kwargs
            sampler = DistributedSampler(self.ids, shuffle=False, **kw)
            return DataLoader(self.ids, batch_size=BATCH // kw["num_replicas"], sampler=sampler)

    def fit(strategy, net, ids):
        task = Task(net, ids)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            precision="64-true",
            max_steps=STEPS,
            enable_checkpointing=False,
            logger=False,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(task)
        out = {}
        for name, p in task.model.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        if strategy_name.startswith("pp") and strategy != "ddp":  # each rank holds its stages' parameters
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, out)
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def rel(a: dict, b: dict) -> float:
        if not b.keys() <= a.keys():  # (a pipeline's last stage also names a tied head: checked under its own name)
            raise RuntimeError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:4]}")
        a = {k: a[k] for k in b}
        # a parameter whose values are round-off (a key bias: its gradient is 0 but for round-off, which AdamW scales
        # up to steps of ~1e-11) has no relative difference to speak of: left out, counted in the row
        real = [k for k in a if b[k].norm() > 1e-6 * b[k].numel() ** 0.5]
        skipped[0] = len(a) - len(real)
        diffs = {k: ((a[k].reshape(b[k].shape) - b[k]).norm() / b[k].norm()).item() for k in real}
        worst[0] = max(diffs, key=diffs.get)
        return diffs[worst[0]]

    worst, skipped = [""], [0]  # the last comparison's parameter of the largest difference; those left out

    rows = []
    for model_type in model_types:
        start = time.perf_counter()
        try:
            net = build(model_type)
            if strategy_name.startswith("pp"):  # the pipeline's `labels` loss: HF's own casts float64 logits to float32
                from lightning_dist.parallelize.pipeline.hf import pipeline_loss_function

                net.loss_function = pipeline_loss_function
            ids = data(int(net.config.get_text_config().vocab_size))  # a multimodal config holds it in its text one
            ref = reference(net, ids)
            if rel(reference(net, ids), ref) > 0:
                rows.append(dict(model=model_type, result="not built", why="one device differs from itself"))
                continue
        except Exception as err:
            rows.append(dict(model=model_type, result="not built", why=f"{type(err).__name__}: {err}"[:300]))
            continue
        finally:
            dist.barrier() if dist.is_initialized() else None
        try:
            cls, kwargs = STRATEGIES[strategy_name]
            strategy = getattr(strategies, cls)(**kwargs, timeout=180)
            got = fit(strategy, copy.deepcopy(net), ids)
            diff = rel(got, ref)
            row = dict(model=model_type, diff=diff, result="exact" if diff <= EXACT else "differs", worst=worst[0])
            checks = {k: getattr(strategy, k, None) for k in ("self_check_report", "ep_check_report", "tp_probe_diff")}
            row["checks"] = {k: getattr(v, "worst", v) for k, v in checks.items() if v is not None}  # their figures
            row["noise_params"] = skipped[0]
            if diff > EXACT:  # the round-off floor of this model (float32 parts inside): 10x it is "at the floor"
                halves = rel(reference(net, ids, halves=True), ref)
                # float32 parts inside (a data-parallel floor far above float64's, or activations computed in float32
                # as the TP probe finds them: an RMSNorm on x.float()): their round-off is float32's
                inner = probe_output(net, torch.device("cpu"))
                noise = 2.0**-24 if halves > 1e-10 or (inner and inner[3]) else 2.0**-52
                row["floor"] = max(rel(reference(net, ids, noise=noise), ref), halves)
                if diff <= 10 * row["floor"]:
                    row["result"] = "at floor"
            rows.append(row)
        except Exception as err:  # a refusal, or a crash: the row keeps the message to judge which
            if os.environ.get("SURVEY_TRACE"):
                __import__("traceback").print_exc()
            rows.append(dict(model=model_type, result="raised", why=f"{type(err).__name__}: {err}"))
        rows[-1]["seconds"] = round(time.perf_counter() - start, 1)
        if os.environ["RANK"] == "0":
            r = rows[-1]
            tail = f"{r.get('diff', 0):.1e}" if "diff" in r else (r.get("why") or "")[:140].replace("\n", " ")
            print(f"{model_type:28s} {r['result']:13s} {tail}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="tp")
    parser.add_argument("--models", default="", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--after", default="", help="start after this model type (resume a survey)")
    parser.add_argument("--until", default="", help="stop after this model type (a survey in parts)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tf.logging.set_verbosity_error()
    types = [m for m in args.models.split(",") if m] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    types = [m for m in types if m > args.after and (not args.until or m <= args.until)]
    if "LOCAL_RANK" not in os.environ:  # the launcher: torchrun with 2 processes, this script per rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dist").setLevel(logging.ERROR)
    rows = run_rank(args.strategy, types)
    if int(os.environ["RANK"]) == 0:
        counts = Counter(r["result"] for r in rows)
        print(
            f"transformers {tf.__version__}, {args.strategy}: {len(rows)} causal LMs; "
            + ", ".join(f"{n} {k}" for k, n in counts.items())
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(transformers=tf.__version__, strategy=args.strategy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
