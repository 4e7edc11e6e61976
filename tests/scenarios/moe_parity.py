"""Mixtures of experts against one device on the global batch, float64, the router's auxiliary loss included.

Unmodified HF Qwen3-MoE and Mixtral (tiny configs, experts run eagerly: float64 on CPU), `output_router_logits=True`
and `router_aux_loss_coef=0.05`: the loss is the cross-entropy plus the coefficient times the model's own `aux_loss`.
``torchrun --nproc-per-node 2 moe_parity.py``: fsdp2 (dp_shard=2), tp=2, tp2 x ep2 (the ep group is the tp group) and
ep=2 (the HF models then exported to safetensors and loaded back by transformers), ep=2 with full activation
checkpointing (the recomputed forward dispatches the tokens again) and ep=2 with the blocks' activations offloaded; with
``local`` as argv[1] also the per-rank auxiliary loss kept on purpose (``moe_aux_loss="local"``), which must differ
from one device's; cp2 x ep2 (ep borrowed from cp); and refusals: ep without experts, transformers' grouped_mm experts
in float64, and (by ep's setup self-check) experts that scale their input by a routing weight and a dispatch whose
expert gradients miss the 1/ep scaling. Every ep run reports its self-check's figures. 4 processes: hsdp 2 x 2, tp2 x
dp_shard2 and the ep layouts (tp2 x ep4 among them, ep from dp_shard x tp; and pp2 x tp2 x ep2 without the router
loss, whose self-check refuses experts ep cannot split), cp2 x dp_shard2 with selective activation checkpointing, and
with ep4 (from dp_shard x cp).
Every model pipelined with its router loss (transformers': its own ``labels`` loss): pp2 (1F1B; GPipe with full
activation checkpointing) on 2 processes, pp2 x dp_shard2, x ep2, x cp2 x ep2 on 4 (and the per-rank loss, which must
differ). The ep2 runs carry the CommunicationLedger and MemoryReport
(measured next to the plan), and one more ep2 run routes every token by a fixed balanced pattern, so its all-to-alls
can be held against the planner's uniform-routing formula.
One RESULT row per case and rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist import planner
from lightning_dist.callbacks import CommunicationLedger, MemoryReport
from lightning_dist.parallelize.ac import apply_offload_activations, checkpointed_mode, offloaded_bytes
from lightning_dist.strategies import (
    FullyShardStrategy,
    HybridShardStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)

STEPS, GLOBAL_BATCH, N, SEQ, VOCAB, COEF = 3, 8, 24, 8, 64, 0.05
MODELS = ("qwen3_moe", "mixtral", "pack_moe", "pack_moe_ds")


def balanced_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`MoE.route` with token i choosing experts (i k + j) mod E, j < k: every expert gets the same number of rows
    (uniform routing, the planner's assumption); the weights are still the router's softmax, renormalized."""
    scores = self.router(x).softmax(-1)
    chosen = (torch.arange(x.shape[0])[:, None] * self.top_k + torch.arange(self.top_k)) % self.n_experts
    weights = scores.gather(-1, chosen)
    return chosen, weights / weights.sum(-1, keepdim=True), scores


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind.startswith("pack_moe"):  # the pack's MoE GPT: top-2 of 8 softmax; DeepSeek-V3 style (sigmoid, 1 shared)
        from lightning_dist.models.moe import MoEGPT

        ds = kind == "pack_moe_ds"  # pack_moe_idle: pack_moe whose experts 6 and 7 are never chosen
        model = MoEGPT(
            vocab_size=VOCAB,
            block_size=SEQ,
            n_layer=2,
            n_head=4,
            n_embd=32,
            n_experts=8,
            top_k=2,
            expert_hidden=8,
            n_shared=1 if ds else 0,
            router="sigmoid" if ds else "softmax",
        ).double()
        for block in model.blocks:
            if kind == "pack_moe_idle":
                block.mlp.select_bias[6:] = -1e9
            if kind == "pack_moe_uniform":  # a model whose routing is the planner's uniform one
                block.mlp.route = balanced_route.__get__(block.mlp)
            # a key bias has zero gradient in exact arithmetic (softmax ignores a shift): AdamW would turn its
            # rounding noise into lr-sized steps, on the reference and the distributed run alike
            block.attn.k.bias.requires_grad_(False)
        return model
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        experts_implementation="eager",
    )
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        return tf.Qwen3MoeForCausalLM(cfg).double()
    assert kind == "mixtral", kind
    return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)).double()


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(0, VOCAB, (N, SEQ), generator=g))


def step_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if isinstance(out, torch.Tensor):  # the pack's MoE GPT: logits, and its router loss from the layers
        return F.cross_entropy(out.flatten(0, 1), y.flatten()) + COEF * model.aux_loss()
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + COEF * out.aux_loss


class Task(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = build(kind)
        self.example_input_array = data().tensors[0][:2]

    def forward(self, x):
        out = self.model(x)
        return out if isinstance(out, torch.Tensor) else out.logits

    def training_step(self, batch, batch_idx):
        return step_loss(self.model, *batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(data(), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)


class OffloadTask(Task):
    """`Task` whose blocks offload the tensors they save for backward, host memory standing in for the device (on a
    CPU the strategies' ``offload_activations=True`` refuses: there is no device memory to free)."""

    def configure_model(self) -> None:
        apply_offload_activations(self.model, pin_memory=False, device_type="cpu")


class CPTask(Task):
    """`Task` under context parallelism: the cross-entropy through ``pipeline_loss`` (the strategy hands it the
    target's chunks of this rank's tokens), the router loss added as in `step_loss`."""

    def pipeline_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return self.pipeline_loss(out, y) + COEF * self.model.aux_loss()
        return self.pipeline_loss(out.logits, y) + COEF * out.aux_loss


class PipeTask(Task):
    """`Task` for a pipeline: the cross-entropy served per micro-batch (``pipeline_loss``), the router loss off (a
    stage holds some layers only: the pipeline refuses that loss, tested below)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        if hasattr(getattr(self.model, "config", None), "output_router_logits"):
            self.model.config.output_router_logits = False

    def pipeline_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)


class PipeAuxTask(PipeTask):
    """`PipeTask` with the pack's router loss: under a pipeline ``aux_loss()`` is answered with the global batch's
    (a counting pass before the schedule), its gradient joining each micro-batch's backward."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y) + COEF * self.model.aux_loss()


class HFPipeAuxTask(Task):
    """An unmodified transformers MoE pipelined with its own ``labels`` loss, which adds the router loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, labels=y).loss


def hf_labels_reference(kind: str) -> dict:
    """One device, the model's own ``labels`` loss plus its router loss (the cross-entropy written out in float64,
    as the pipeline computes it: transformers' own casts float64 logits to float32)."""
    from lightning_dist.parallelize.pipeline.hf import pipeline_loss_function

    model = build(kind)
    model.loss_function = pipeline_loss_function
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data()
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        model(x, labels=y).loss.backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def pipelined_router_loss(world: int) -> None:
    """Mixtures of experts pipelined with their router loss, against one device with it."""
    if world == 2:
        cases = {
            "pp2_1f1b": dict(pp=2, n_microbatches=4),
            "pp2_gpipe_ac_full": dict(pp=2, schedule="gpipe", n_microbatches=2, activation_checkpointing="full"),
        }
    else:  # the statistics summed over the data-parallel ranks (dp_shard, cp) before the loss; "local": not
        cases = {
            "pp2_dp2": dict(pp=2, n_microbatches=2),
            "pp2_ep2": dict(pp=2, ep=2, n_microbatches=2),
            "pp2_cp2_ep2": dict(pp=2, cp=2, ep=2, n_microbatches=2),  # ep borrowed from cp, as without pipelines
            "pp2_dp2_local": dict(pp=2, n_microbatches=2, moe_aux_loss="local"),
        }
    for kind in MODELS:
        hf = not kind.startswith("pack_moe")
        ref = hf_labels_reference(kind) if hf else reference(kind)
        for case, kw in cases.items():
            task = HFPipeAuxTask(kind) if hf else PipeAuxTask(kind)
            trainer(PipelineStrategy(**kw), devices=world, steps=STEPS).fit(task)
            held = full_params(task)  # this stage's parameters
            diff = max_rel_diff(held, {k: ref[k] for k in held})
            emit(kind="moe_pp_aux", model=kind, case=case, diff=diff, ep=ep_degree(task), held=len(held))


def pipe_reference(kind: str) -> dict:
    task = PipeTask(kind)
    opt = torch.optim.AdamW(task.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data()
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        task.pipeline_loss(task(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in task.named_parameters()}


def ep_check(strategy: Any) -> dict | None:
    """The ep self-check's figures (None: it did not run)."""
    report = getattr(strategy, "ep_check_report", None)
    return None if report is None else {"modules": report.blocks, "worst": report.worst}


def tp_check(strategy: Any) -> dict | None:
    """The tp self-check's figures (None: it did not run)."""
    report = getattr(strategy, "self_check_report", None)
    return None if report is None else {"blocks": report.blocks, "worst": report.worst}


def ep_degree(task: pl.LightningModule) -> int:
    """The ep degree the experts modules of `task` run at (1: expert parallelism not applied), the same for all."""
    from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY, find_experts

    degrees = {m.__dict__.get(GLOBAL_EXPERTS_KEY, {}).get("ranks", 1) for _, m in find_experts(task.model)}
    assert len(degrees) == 1, degrees
    return degrees.pop()


def reference(kind: str) -> dict:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data()
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        step_loss(model, x, y).backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    activations = {}  # case -> (strategy, task): the router loss global, activations recomputed or offloaded
    if world == 2:
        cases = {
            "fsdp2": lambda **kw: FullyShardStrategy(**kw),
            "tp2": lambda **kw: TensorParallelStrategy(tp=2, **kw),
            "ep2": lambda **kw: FullyShardStrategy(ep=2, **kw),
            "tp2_ep2": lambda **kw: TensorParallelStrategy(tp=2, ep=2, **kw),  # the ep group is the tp group
        }
        activations = {
            "ep2_ac_full": (lambda: FullyShardStrategy(ep=2, activation_checkpointing="full"), Task),
            "ep2_offload": (lambda: FullyShardStrategy(ep=2), OffloadTask),
        }
    else:
        cases = {
            "hsdp2x2": lambda **kw: HybridShardStrategy(dp_replicate=2, shard_size=2, **kw),
            "tp2_dp_shard2": lambda **kw: TensorParallelStrategy(tp=2, dp_shard=2, dp_replicate=1, **kw),
            "ep4": lambda **kw: FullyShardStrategy(ep=4, **kw),
            "ep2_dp_shard2": lambda **kw: FullyShardStrategy(ep=2, **kw),
            "hsdp2x2_ep2": lambda **kw: HybridShardStrategy(dp_replicate=2, shard_size=2, ep=2, **kw),
            "tp2_ep4": lambda **kw: TensorParallelStrategy(tp=2, ep=4, **kw),  # ep from dp_shard x tp, tp peers first
        }
    modes = ("global", "local") if sys.argv[1:2] == ["local"] else ("global",)
    if world == 4:  # the last ep rank's experts (6 and 7 of 8) never chosen: it receives no token and sends none
        ref = reference("pack_moe_idle")
        task = Task("pack_moe_idle")
        trainer(FullyShardStrategy(ep=4), devices=world, steps=STEPS).fit(task)
        from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY

        arrived = [b.mlp.experts.__dict__[GLOBAL_EXPERTS_KEY]["arrived"] for b in task.model.blocks]
        diff = max_rel_diff(full_params(task), ref)
        emit(kind="moe", model="pack_moe_idle", case="ep4", mode="global", diff=diff, arrived=arrived)
    for kind in MODELS:
        ref = reference(kind)
        for case, make in cases.items():
            for mode in modes:
                task = Task(kind)
                kw = {} if mode == "global" else {"moe_aux_loss": "local"}
                # the ep2 runs: the ledger's and memory report's rows next to the plan under the routing they had
                reports = ledger_and_memory() if case == "ep2" and mode == "global" else []
                strategy = make(**kw)
                trainer(strategy, devices=world, steps=STEPS, callbacks=reports).fit(task)
                diff = max_rel_diff(full_params(task), ref)
                checks = {"ep_check": ep_check(strategy), "tp_check": tp_check(strategy)}
                emit(kind="moe", model=kind, case=case, mode=mode, diff=diff, ep=ep_degree(task), **checks)
                if reports:
                    emit(kind="ep_plan", model=kind, **plan_ratios(*reports))
                if case == "ep2" and mode == "global" and not kind.startswith("pack_moe"):
                    exported_to_hf(task, kind)
        for case, (make, cls) in activations.items():
            task = cls(kind)
            trainer(make(), devices=world, steps=STEPS).fit(task)
            emit(
                kind="moe_activations",
                model=kind,
                case=case,
                diff=max_rel_diff(full_params(task), ref),
                ep=ep_degree(task),
                checkpointed=sum(checkpointed_mode(m) == "full" for m in task.model.modules()),
                offloaded=offloaded_bytes(task.model) or 0,
            )
    if world == 2:
        capacity_factor()
    if world == 4:
        checkpoints_across_ep_degrees()
        for kind in MODELS:  # cp2 x dp_shard2 with selective AC: the router loss over the dp x cp ranks' tokens
            ref = reference(kind)
            for case, ep, ac in (("cp2_sac", 1, "selective"), ("cp2_ep4", 4, None)):  # ep4: from dp_shard x cp
                task = CPTask(kind)
                strategy = FullyShardStrategy(cp=2, ep=ep, activation_checkpointing=ac)
                trainer(strategy, devices=world, steps=STEPS).fit(task)
                diff = max_rel_diff(full_params(task), ref)
                emit(
                    kind="moe",
                    model=kind,
                    case=case,
                    mode="global",
                    diff=diff,
                    ep=ep_degree(task),
                    ep_check=ep_check(strategy),
                )
        for kind in MODELS:  # pp2 x tp2 x ep2: each stage's experts split over its tp ranks (no router loss: see below)
            ref = pipe_reference(kind)
            task = PipeTask(kind)
            strategy = PipelineStrategy(pp=2, tp=2, ep=2, n_microbatches=2)
            trainer(strategy, devices=world, steps=STEPS).fit(task)
            held = full_params(task)  # this stage's parameters
            diff = max_rel_diff(held, {k: ref[k] for k in held})
            check = strategy.ep_check_report  # the ep self-check through the schedule, at setup
            check = None if check is None else {"modules": check.blocks, "worst": check.worst}
            emit(
                kind="moe_pp",
                model=kind,
                case="pp2_tp2_ep2",
                diff=diff,
                ep=ep_degree(task),
                held=len(held),
                ep_check=check,
            )

        class ScaledPipe(PipeTask):  # experts that scale their input by a routing weight: ep cannot split them
            def __init__(self) -> None:
                super().__init__("pack_moe")
                for block in self.model.blocks:
                    block.mlp.experts.forward = types.MethodType(scaled_input_forward, block.mlp.experts)

        try:  # refused by the ep self-check through the schedule, on every rank, before any step
            trainer(PipelineStrategy(pp=2, ep=2, n_microbatches=2), devices=world, steps=1).fit(ScaledPipe())
            emit(kind="refusal", case="pp_ep_scaled_input", error=None)
        except ValueError as err:
            emit(kind="refusal", case="pp_ep_scaled_input", error=str(err))
    if world == 2:
        # refused on every rank before any collective: ep on a model without experts, cp with ep, grouped_mm in float64
        from lightning_dist.models import GPT

        class Dense(Task):
            def __init__(self) -> None:
                pl.LightningModule.__init__(self)
                torch.manual_seed(0)
                self.model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32).double()

        class GroupedMM(Task):  # transformers' default experts kernel, which torch does not serve in float64 on CPU
            def __init__(self) -> None:
                super().__init__("qwen3_moe")
                self.model.set_experts_implementation("grouped_mm")

        class ScaledInput(Task):  # experts that scale their input by a routing weight: ep's dispatch cannot split them
            def __init__(self) -> None:
                super().__init__("pack_moe")
                for block in self.model.blocks:
                    block.mlp.experts.forward = types.MethodType(scaled_input_forward, block.mlp.experts)

        plain = contextlib.nullcontext
        for case, make, task, during in (
            ("ep_dense", lambda: FullyShardStrategy(ep=2), Dense, plain),
            ("grouped_mm", lambda: FullyShardStrategy(ep=2), GroupedMM, plain),
            ("ep_scaled_input", lambda: FullyShardStrategy(ep=2), ScaledInput, plain),
            ("ep_unscaled_grads", lambda: FullyShardStrategy(ep=2), lambda: Task("pack_moe"), unscaled_expert_grads),
        ):
            try:
                with during():
                    trainer(make(), devices=world, steps=1).fit(task())
                emit(kind="refusal", case=case, error=None)
            except ValueError as err:
                emit(kind="refusal", case=case, error=str(err))
    pipelined_router_loss(world)
    if world == 2:
        for kind in MODELS:  # cp2 x ep2: every ep rank a cp peer (ep borrowed from cp)
            task = CPTask(kind)
            strategy = FullyShardStrategy(cp=2, ep=2)
            trainer(strategy, devices=world, steps=STEPS).fit(task)
            diff = max_rel_diff(full_params(task), reference(kind))
            emit(
                kind="moe_cp_ep", model=kind, case="cp2_ep2", diff=diff, ep=ep_degree(task), ep_check=ep_check(strategy)
            )
        uniform_routing_against_the_planner()


def capacity_factor() -> None:
    """ep2 with token dropping asked for, on the pack's MoEGPT and the HF models: a factor as large as the number of
    experts (every pair fits) and 0.5 (pairs dropped)."""
    from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY, expert_count, find_experts

    for kind in ("pack_moe", "qwen3_moe", "mixtral"):
        ref = reference(kind)
        for case in ("ep2_capacity_all", "ep2_capacity_0.5"):
            task = Task(kind)
            experts = [m for _, m in find_experts(task.model)]
            factor = float(expert_count(experts[0])) if case == "ep2_capacity_all" else 0.5
            trainer(FullyShardStrategy(ep=2, ep_capacity_factor=factor), devices=2, steps=STEPS).fit(task)
            states = [m.__dict__[GLOBAL_EXPERTS_KEY] for m in experts]
            emit(
                kind="ep_capacity",
                model=kind,
                case=case,
                diff=max_rel_diff(full_params(task), ref),
                dropped=[s["dropped"] for s in states],
                capacity=[s.get("capacity") for s in states],
                arrived=[s["arrived"] for s in states],
                local_experts=[s["experts"] // s["ranks"] for s in states],
                ep_check=task.trainer.strategy.ep_check_report.worst,
            )


def scaled_input_forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The pack's experts with their input scaled by the first routing weight (inside the experts' nonlinearity)."""
    return type(self).forward(self, x * (1 + w[:, :1]), idx, w)


@contextlib.contextmanager
def unscaled_expert_grads():
    """Test-only: expert parallelism without its `1/ep` gradient scaling (the local experts' gradient hook dropped),
    so the expert gradients are ep times too large while every output is right."""
    from lightning_dist.parallelize import ep

    enter, register_hook = ep._LocalParams.__enter__, torch.Tensor.register_hook

    def without_hook(local_params) -> None:
        torch.Tensor.register_hook = lambda self, hook: None
        try:
            enter(local_params)
        finally:
            torch.Tensor.register_hook = register_hook

    ep._LocalParams.__enter__ = without_hook
    try:
        yield
    finally:
        ep._LocalParams.__enter__ = enter


def ledger_and_memory() -> list:
    return [CommunicationLedger(log=False, print_table=False), MemoryReport(log=False, print_table=False)]


def plan_ratios(ledger: CommunicationLedger, memory: MemoryReport) -> dict:
    """Measured / planned of every ledger row that has a plan, the all-to-alls', and the model states' (all, and the
    routed experts')."""
    (row,) = [r for r in memory.rows if r["rank"] == torch.distributed.get_rank()]
    return {
        "ledger": {f"{r['op']}/{r['dim']}": r["ratio"] for r in ledger.summary},
        "all_to_all": [(r["dim"], r["count"], r["ratio"]) for r in ledger.summary if r["op"] == "all_to_all"],
        "states": row["ratio"],
        "expert_states": row["experts"]["ratio"],
    }


def uniform_routing_against_the_planner() -> None:
    """ep2 on a model routing by a fixed balanced pattern: the ledger's all-to-all bytes against the planner's formula
    under uniform routing (rows = the rank's tokens x top_k, received as many), and the experts' states against the
    closed form (E / ep per rank, FSDP2 over the dp_shard / ep ranks left)."""
    ledger, memory = ledger_and_memory()
    task = Task("pack_moe_uniform")
    trainer(FullyShardStrategy(ep=2), devices=2, steps=STEPS, callbacks=[ledger, memory]).fit(task)
    model = task.model
    tokens = GLOBAL_BATCH // 2 * SEQ  # this rank's tokens per step
    moe = model.blocks[0].mlp
    a2a = planner.ep_all_to_all(
        rows=tokens * moe.top_k,
        hidden=model.config.n_embd,
        bytes_per_element=8,
        experts=moe.n_experts,
        ep=2,
        layers=len(model.blocks),
    )
    measured = {r["op"]: r["bytes"] for r in ledger.summary if r["op"] == "all_to_all"}
    (row,) = [r for r in memory.rows if r["rank"] == torch.distributed.get_rank()]
    expert_params = sum(p.numel() for b in model.blocks for p in b.mlp.experts.parameters())
    _, experts = planner.ep_state_bytes(0, expert_params, shard_size=2, ep=2, state=planner.StateBytes.fp64_adam())
    emit(
        kind="ep_uniform",
        a2a_measured=measured["all_to_all"],
        a2a_uniform=sum(c.payload_bytes for c in a2a),
        received=ledger.routing_per_step(),
        expert_states_closed_form=row["experts"]["measured"]["total"] / experts.total,
        **plan_ratios(ledger, memory),
    )


def exported_to_hf(task: Task, kind: str) -> None:
    """The model trained at ep=2 (experts as DTensors on the ep mesh) exported by the pack's ``save_hf_pretrained``:
    transformers' ``from_pretrained`` loads every trained weight, exactly, from tensors named and shaped as
    transformers itself saves the unsharded model (its per-expert checkpoint layout)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch.distributed as dist
    from safetensors import safe_open

    from lightning_dist.hf import save_hf_pretrained

    def layout(folder: Path) -> dict:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}

    trained = full_params(task)
    box = [Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    folder = box[0]
    save_hf_pretrained(task, folder / "ep2")
    row: dict = {}
    if dist.get_rank() == 0:
        build(kind).save_pretrained(str(folder / "own"))  # transformers' own layout of the same, unsharded, model
        loaded, info = type(task.model).from_pretrained(
            str(folder / "ep2"), experts_implementation="eager", dtype=torch.float64, output_loading_info=True
        )
        got = {f"model.{n}": p.detach() for n, p in loaded.named_parameters()}
        stored = layout(folder / "ep2")
        row = {
            "same_names": got.keys() == trained.keys(),
            "diff": max((got[k] - v).abs().max().item() for k, v in trained.items() if k in got),
            "not_loaded": sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]),
            "own_layout": stored == layout(folder / "own"),
            "expert_tensors": sum(".experts." in k for k in stored),
        }
    emit(kind="hf_export", model=kind, **row)
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def checkpoints_across_ep_degrees() -> None:
    """Trained at ep=4 and saved (sharded), resumed at ep=2 for one more step, saved and consolidated into one file for
    one device: the weights and AdamW's state arrive exactly each time."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch.distributed as dist
    from lightning.pytorch import Callback

    from lightning_dist.checkpoint import consolidate

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.params = full_params(pl_module)
            self.steps = sorted({float(s["step"]) for s in trainer.optimizers[0].state.values()})

    box = [Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    folder = box[0]
    ref = reference("pack_moe")
    task = Task("pack_moe")
    t = trainer(FullyShardStrategy(ep=4), devices=4, steps=STEPS)
    t.fit(task)
    saved = full_params(task)
    t.save_checkpoint(folder / "ep4")
    at_start = AtStart()
    resumed = Task("pack_moe")
    t = trainer(FullyShardStrategy(ep=2), devices=4, steps=STEPS + 1, callbacks=[at_start])
    t.fit(resumed, ckpt_path=folder / "ep4")  # one more step at ep=2
    t.save_checkpoint(folder / "ep2")
    final = full_params(resumed)
    row = {
        "trained_diff": max_rel_diff(saved, ref),
        "ep2_loaded_diff": max((at_start.params[k] - v).abs().max().item() for k, v in saved.items()),
        "ep2_adam_steps": at_start.steps,
    }
    if dist.get_rank() == 0:
        consolidate(folder / "ep2", folder / "single.ckpt")
        state = torch.load(folder / "single.ckpt", weights_only=True)["state_dict"]
        single = Task("pack_moe")
        single.load_state_dict(state)
        row["single_diff"] = max((p.detach() - final[n]).abs().max().item() for n, p in single.named_parameters())
    emit(kind="ep_checkpoint", **row)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
