"""PipelineStrategy on unmodified real models against one device on the global batch, float64 (issue 14).

Models: HF ``LlamaForCausalLM``, HF ``Qwen2ForCausalLM`` (grouped-query attention), HF ``GPT2LMHeadModel``
(head tied to the token embedding) and the pack's ``GPT(tie_weights=True)``; 8 blocks each; at pp=2 also litgpt's
``GPT`` (4 blocks in ``transformer.h`` inside a child ModuleDict, skipped when litgpt is not installed). HF models get
dict batches (``input_ids``, ``attention_mask`` with right padding, ``labels`` with -100 on the padding)
and return ``out.loss`` by HF's labels convention; the pack's GPT and litgpt's take ``(ids, targets)`` and
``pipeline_loss``. One micro-batch per sample, so micro-batches hold different numbers of labelled tokens.

``python -m torch.distributed.run --nproc-per-node=2 pipeline_real_models.py pp2``: 1F1B and interleaved at pp=2.
``--nproc-per-node=4 ... pp4``: pp=2 x dp=2 (1F1B, FSDP2 on dp), then 1F1B and interleaved at pp=4; and Llama at
pp=2 x tp=2 (the built-in tensor-parallel plan inside each stage). pp2 also resumes checkpoints (see `resume`)
and runs GradientParityCheck and PipelineBubble on HF Llama (see `callbacks_on_hf`).
Each rank reports the max relative difference of the parameters it holds from the reference trained in
the same process, and the logged loss of the last step against the reference's.
"""

import importlib.util
import itertools
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import emit_gathered as emit
from _common import trainer
from _nanogpt import FlatGPT, NanoGPT
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.models import GPT
from lightning_dist.parallelize.pipeline.hf import hf_labels_loss
from lightning_dist.strategies import PipelineStrategy

WORLD = int(os.environ.get("WORLD_SIZE", "2"))
STEPS, GLOBAL_BATCH, N, SEQ, VOCAB, LAYERS = 3, 8, 24, 8, 32, 8
MODELS = ("llama", "qwen2_gqa", "gpt2_tied", "pack_gpt_tied")
# user GPTs written the nanoGPT way (issue 40): `transformer.h` in a ModuleDict with a tied head, and blocks directly
# on the model; 4 blocks each
USER_GPTS = ("nanogpt_tied", "flat_gpt")
# HF models whose forward computes around the blocks: Granite scales the embeddings and the logits, OLMo ends with a
# norm without parameters (a stage without the head hands on its last block's output, not the forward's result)
AROUND_BLOCKS = ("granite", "olmo")
HF = ("llama", "qwen2_gqa", "gpt2_tied", "qwen3", "olmo2", *AROUND_BLOCKS)
# litgpt's GPT, unchanged: its block list `transformer.h` sits inside the ModuleDict `transformer` (pp=2 launch only)
LITGPT = ("litgpt",) if importlib.util.find_spec("litgpt") is not None else ()
PADS = (0, 1, 1, 0)  # right padding of sample i: i % 4 (each dp rank's batch holds as many labelled tokens)


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    if kind == "pack_gpt_tied":
        model = GPT(
            vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=16, mlp_ratio=2, tie_weights=True
        )
    elif kind in USER_GPTS:
        # no biases, as litgpt's below (nanoGPT's `bias=False`)
        model = (NanoGPT if kind == "nanogpt_tied" else FlatGPT)(vocab_size=VOCAB, block_size=16, n_layer=4, bias=False)
    elif kind == "litgpt":
        import litgpt

        # no biases: the key part of the fused qkv bias has zero gradient in exact arithmetic (see below)
        model = litgpt.GPT(
            litgpt.Config(
                n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB, bias=False
            )
        )
    else:
        import transformers as tf

        common = dict(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            max_position_embeddings=16,
        )
        if kind == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=4))
        elif kind == "qwen2_gqa":
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2))
        elif kind == "qwen3":  # per-head q/k norms: under tp their gradients are summed (the split-flow rule)
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=4))
        elif kind == "olmo2":  # q/k norms over the whole projection: under tp its own plan gathers q/k/v
            model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common, num_key_value_heads=4, eos_token_id=0))
        elif kind == "granite":
            cfg = tf.GraniteConfig(**common, num_key_value_heads=2, embedding_multiplier=2.0, logits_scaling=4.0)
            model = tf.GraniteForCausalLM(cfg)
        elif kind == "olmo":
            model = tf.OlmoForCausalLM(tf.OlmoConfig(**common, num_key_value_heads=4, pad_token_id=0, eos_token_id=0))
        else:
            model = tf.GPT2LMHeadModel(
                tf.GPT2Config(
                    vocab_size=VOCAB,
                    n_embd=16,
                    n_layer=LAYERS,
                    n_head=4,
                    n_positions=16,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                    bos_token_id=0,
                    eos_token_id=0,
                )
            )
    model = model.double()
    for name, p in model.named_parameters():
        # a key bias has zero gradient in exact arithmetic (softmax is shift-invariant): AdamW would turn its
        # rounding noise into lr-sized steps, on the reference and the pipeline alike
        if name.endswith(("k_proj.bias", "attn.k.bias")):
            p.requires_grad_(False)
    return model


class Tokens(Dataset):
    def __init__(self, hf: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (N, SEQ + 1), generator=g)
        self.hf = hf

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if not self.hf:  # the pack's GPT: (ids, next-token targets)
            return self.ids[i, :-1], self.ids[i, 1:]
        ids = self.ids[i, :-1]
        mask = torch.ones(SEQ, dtype=torch.long)
        if PADS[i % 4]:
            mask[-PADS[i % 4] :] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def step_loss(model, batch, hf: bool, loss=None):
    """HF: `out.loss` of a call with labels; the pack's GPT: `loss(model(ids), target)` (a task's pipeline_loss)."""
    if hf:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return out.loss
    ids, target = batch
    return (loss or gpt_loss)(model(ids), target)


def gpt_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))


class Task(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.hf = kind in HF
        self.model = build(kind)
        self.step_losses: list[float] = []
        if not self.hf:  # the pack's GPT: its own loss hook (HF models use their `labels`)
            self.pipeline_loss = gpt_loss

    def training_step(self, batch, batch_idx):
        loss = step_loss(self.model, batch, self.hf, getattr(self, "pipeline_loss", None))
        self.step_losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # forward-only programs through the pipeline, kwargs included
        self.log(
            "val_loss", step_loss(self.model, batch, self.hf, getattr(self, "pipeline_loss", None)), sync_dist=True
        )

    def val_dataloader(self):
        return self.train_dataloader()

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(Tokens(self.hf), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def reference(kind: str, steps: int = STEPS):
    """One device, the global batch, the same AdamW; the same loss (HF labels convention in float64)."""
    model, hf = build(kind), kind in HF
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader, losses = DataLoader(Tokens(hf), batch_size=GLOBAL_BATCH), []
    for batch in itertools.islice(itertools.chain.from_iterable(itertools.repeat(loader)), steps):
        opt.zero_grad()
        if hf:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = hf_labels_loss(logits, batch["labels"])
        else:
            loss = step_loss(model, batch, hf)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    with torch.no_grad():  # the validation loss of the trained model: the mean over the loader's batches
        vals = [
            (
                hf_labels_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
                if hf
                else step_loss(model, b, hf)
            ).item()
            for b in loader
        ]
    reference.val = sum(vals) / len(vals)
    # every name of a tied parameter (the last stage holds the tied head under its own name)
    return {f"model.{k}": p.detach() for k, p in model.named_parameters(remove_duplicate=False)}, losses


def run(tag: str, kind: str, **strategy_kw) -> None:
    from torch.distributed.tensor import DTensor

    ref, ref_losses = reference(kind)
    task = Task(kind)
    local = GLOBAL_BATCH // (WORLD // (strategy_kw["pp"] * strategy_kw.get("tp", 1)))  # per data-parallel rank
    strategy = PipelineStrategy(n_microbatches=local, **strategy_kw)  # one sample per micro-batch
    t = trainer(strategy, devices=WORLD, steps=STEPS, num_sanity_val_steps=0)
    t.fit(task)
    logged, ref_val = t.callback_metrics["train_loss"].item(), reference.val  # before validate resets the metrics
    val = t.validate(task, verbose=False)[0]["val_loss"]
    diff, keys = 0.0, []
    for name, p in task.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        diff = max(diff, ((full - ref[name]).norm() / ref[name].norm()).item())
        keys.append(name)
    emit(
        kind="parity",
        tag=tag,
        model=kind,
        diff=diff,
        keys=keys,
        all_keys=sorted(ref),
        losses=task.step_losses,
        ref_losses=ref_losses,
        logged=logged,
        stages=strategy.local_stages,
        val=val,
        ref_val=ref_val,
        split=[list(s.blocks) for s in strategy.split.stages],
        shape=list(strategy.mesh.spec.shape),
        tied=[
            [n for n in names]
            for names, _ in __import__("lightning_dist.parallelize.pipeline.checks", fromlist=["x"]).tied_stages(
                build(kind), strategy.split
            )
        ],
    )


def resume(kind: str) -> None:
    """One epoch (3 steps) with 1F1B, a sharded checkpoint, resumed interleaved to 4 steps == 4 reference steps;
    the consolidated file loads strictly into the plain single-device model. A tied head is saved once (one key in
    each sharded checkpoint, model and optimizer) and given back to every name of the plain model on consolidation."""
    import tempfile

    import torch.distributed as dist

    from lightning_dist import checkpoint as ckpt

    ref, _ = reference(kind, steps=4)
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], f"{kind}.ckpt")
    first = trainer(PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=GLOBAL_BATCH), devices=WORLD, steps=3)
    first.fit(Task(kind))
    first.save_checkpoint(path)
    task = Task(kind)
    second = PipelineStrategy(pp=2, schedule="interleaved_1f1b", n_microbatches=GLOBAL_BATCH)
    t = trainer(second, devices=WORLD, steps=4)
    t.fit(task, ckpt_path=path)
    diff = max(((p.detach() - ref[n]).norm() / ref[n].norm()).item() for n, p in task.named_parameters())
    t.save_checkpoint(path + "4")
    single_diff, saved, stored = None, {}, {}
    if dist.get_rank() == 0:
        import torch.distributed.checkpoint as dcp

        from lightning_dist.parallelize.pipeline.checks import tied_stages

        tied = [f"model.{n}" for names, _ in tied_stages(build(kind), first.strategy.split) for n in names]
        for name in (path, path + "4"):  # the keys of the tied weight's copies in each sharded checkpoint
            keys = dcp.FileSystemReader(name).read_metadata().state_dict_metadata
            saved[os.path.basename(name)] = {
                "model": sum(f"{ckpt.MODEL_KEY}.{n}" in keys for n in tied),
                "optimizer": sum(f"optimizer_0.state.{n}.exp_avg" in keys for n in tied),
            }
        ckpt.consolidate(path + "4", path + "4.pt")
        full = torch.load(path + "4.pt", map_location="cpu", weights_only=True)
        single = Task(kind)
        single.load_state_dict(full[ckpt.MODEL_KEY], strict=True)
        single_diff = max(
            ((p.detach() - ref[n]).norm() / ref[n].norm()).item()
            for n, p in single.named_parameters(remove_duplicate=False)
        )
        # the consolidated file: every tied name there (strict load), one storage behind them; its optimizer
        # state has one entry per parameter of the plain model (tied counted once, as a single-device optimizer)
        stored = {
            "names": sum(n in full[ckpt.MODEL_KEY] for n in tied),
            "storages": len({full[ckpt.MODEL_KEY][n].untyped_storage().data_ptr() for n in tied}),
            "optimizer_params": sum(len(g["params"]) for g in full["optimizer_states"][0]["param_groups"]),
            "model_params": len(list(single.parameters())),
        }
    emit(
        kind="resume",
        tag=f"resume_{kind}",
        model=kind,
        diff=diff,
        global_step=t.global_step,
        stages=second.local_stages,
        single_diff=single_diff,
        saved=saved,
        stored=stored,
    )


def callbacks_on_hf() -> None:
    """GradientParityCheck and PipelineBubble on HF Llama at pp=2 (1F1B): the check passes in float64 (its
    reference computes HF's `labels` loss as the pipeline does, in float64) and catches a planted error (one
    gradient scaled on one rank after backward); PipelineBubble reports an idle fraction."""
    from lightning.pytorch.callbacks import Callback
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_dist.callbacks import GradientParityCheck
    from lightning_dist.callbacks.pipeline_bubble import PipelineBubble

    def hf_own_loss(module, batch):  # HF's own loss (float32 upcast) on the reference: measured, for the report
        logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return ForCausalLMLoss(logits, batch["labels"], vocab_size=VOCAB)

    class ScaleOneGradient(Callback):  # the planted error: rank 1's first parameter gradient x 1.001 at step 0
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_rank == 1 and trainer.global_step == 0:
                next(p for p in pl_module.parameters() if p.grad is not None).grad.mul_(1.001)

    check, hf_check, bubble = (
        GradientParityCheck(steps=(0, 2)),
        GradientParityCheck(steps=(0,), on_mismatch="warn"),
        PipelineBubble(warmup_steps=0),
    )
    hf_check.loss_fn = hf_own_loss
    t = trainer(
        PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=GLOBAL_BATCH),
        devices=WORLD,
        steps=STEPS,
        callbacks=[check, hf_check, bubble],
    )
    t.fit(Task("llama"))
    planted = GradientParityCheck(steps=(0,), on_mismatch="warn")
    t2 = trainer(
        PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=GLOBAL_BATCH),
        devices=WORLD,
        steps=1,
        callbacks=[ScaleOneGradient(), planted],
    )
    t2.fit(Task("llama"))
    emit(
        kind="callbacks",
        tag="callbacks_llama",
        parity=[(r["rel_diff"], r["tolerance"], r["ok"]) for r in check.results],
        hf_own_loss_rel=hf_check.results[0]["rel_diff"],
        idle=[s["idle_fraction"] for s in bubble.steps],
        planted=[(r["rel_diff"], r["ok"]) for r in planted.results],
    )


def main() -> None:
    mode = sys.argv[1]
    for kind in MODELS:
        if mode == "pp2":
            run(f"pp2_1f1b_{kind}", kind, pp=2, schedule="1f1b")
            run(f"pp2_interleaved_{kind}", kind, pp=2, schedule="interleaved_1f1b")
        else:
            run(f"pp2xdp2_1f1b_{kind}", kind, pp=2, dp_shard=2, schedule="1f1b")
            run(f"pp4_1f1b_{kind}", kind, pp=4, schedule="1f1b")
            run(f"pp4_interleaved_{kind}", kind, pp=4, schedule="interleaved_1f1b")
    for kind in (
        (*LITGPT, *USER_GPTS, *AROUND_BLOCKS) if mode == "pp2" else ()
    ):  # 1F1B and interleaved (4 stages of 1 block)
        run(f"pp2_1f1b_{kind}", kind, pp=2, schedule="1f1b")
        run(f"pp2_interleaved_{kind}", kind, pp=2, schedule="interleaved_1f1b")
    for kind in USER_GPTS if mode == "pp4" else ():  # the user GPTs with data parallelism beside the pipeline
        run(f"pp2xdp2_1f1b_{kind}", kind, pp=2, dp_shard=2, schedule="1f1b")
    if mode == "pp4":  # tensor parallelism inside the stages of unmodified models (the built-in plan; a head tied
        # across stages is refused with tp > 1, so the untied user GPT)
        for kind in ("llama", "qwen3", "olmo2", "flat_gpt"):
            run(f"pp2xtp2_1f1b_{kind}", kind, pp=2, tp=2, schedule="1f1b")
    if mode == "pp2":  # activation checkpointing modes per stage, HF Llama and the pack's GPT
        run("pp2_1f1b_llama_ac_selective", "llama", pp=2, schedule="1f1b", activation_checkpointing="selective")
        run(
            "pp2_interleaved_llama_ac_every2",
            "llama",
            pp=2,
            schedule="interleaved_1f1b",
            activation_checkpointing="every:2",
        )
        # zero-bubble schedules recompute each checkpointed block in both backward passes (input, then weight
        # gradients); HF stages hand on their hidden states, not a view of them, which that backward detaches
        run("pp2_zero_bubble_llama_ac_full", "llama", pp=2, schedule="zero_bubble", activation_checkpointing="full")
        run(
            "pp2_interleaved_zero_bubble_qwen2_gqa_ac_every2",
            "qwen2_gqa",
            pp=2,
            schedule="interleaved_zero_bubble",
            activation_checkpointing="every:2",
        )
        run(
            "pp2_1f1b_pack_gpt_tied_ac_selective",
            "pack_gpt_tied",
            pp=2,
            schedule="1f1b",
            activation_checkpointing="selective",
        )
    if mode == "pp2":  # after the fits above: the process group they started is there for the temp-dir broadcast
        for kind in ("llama", "gpt2_tied"):
            resume(kind)
        callbacks_on_hf()


if __name__ == "__main__":
    main()
