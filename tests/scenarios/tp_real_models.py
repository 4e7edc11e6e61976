"""Tensor parallelism with tp_plan="auto" on models nobody on this project wrote (torchrun, 2 or 4 processes).

Tiny random HuggingFace Llama, Qwen2 (grouped-query attention), GPT-2 (Conv1D, tied head), GPT-NeoX, a
plain user GPT (q, k, v, o Linear; nn.Sequential MLP; head count read from an attribute), the same with the
head count read from a config object shared by the layers (litgpt style), the pack's GPT(tie_weights=True)
Lightning's demos.Transformer (nn.Transformer: only its MLPs split; MultiheadAttention stays whole) and, when
installed, litgpt's GPT with multi-head attention (litgpt_mha; its GQA variant is refused by name): float64, 3 AdamW
steps, max relative parameter difference vs single-device training
on the global batch computed in this process. 2 processes: tp=2; 4 processes: tp=2 x dp_shard=2. The same
launches check FSDP2 units (2 processes) and HuggingFace weights in and out of sharded models (see the end).
Each run has GradientParityCheck at step 0 (tied models: no false alarm). One RESULT row per model.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from lightning.pytorch.demos import Transformer as DemoTransformer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.callbacks import CommunicationLedger, GradientParityCheck
from lightning_dist.models import GPT
from lightning_dist.parallelize.shared import shared_parameters
from lightning_dist.parallelize.units import select_units
from lightning_dist.strategies import FullyShardStrategy, TensorParallelStrategy

STEPS, GLOBAL_BATCH, N, SEQ, VOCAB = 3, 8, 24, 8, 64


class UserAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, config=None, fused: bool = False) -> None:
        super().__init__()
        self.n_head = n_head  # read in forward: the plan must make it the local count
        self.config = config  # litgpt style: heads read from a config object shared by every layer
        if fused:  # one projection laid out [q | k | v] (not head-major)
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        heads = self.config.n_head if self.config is not None else self.n_head
        qkv = self.qkv(x).chunk(3, dim=-1) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(B, T, heads, -1).transpose(1, 2) for t in qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class UserBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, config=None, fused: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = UserAttention(dim, n_head, config, fused)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class UserGPT(nn.Module):
    def __init__(self, dim: int = 32, n_head: int = 4, depth: int = 2, config=None, fused: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(UserBlock(dim, n_head, config, fused) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def build(kind: str) -> nn.Module:
    model = _build(kind)
    for name, p in model.named_parameters():
        # a key bias has zero gradient in exact arithmetic (softmax is shift-invariant): AdamW would turn its
        # rounding noise (~1e-17) into lr-sized steps, on the reference and TP runs alike
        if name.endswith(("k_proj.bias", "attn.k.bias", ".k.bias")):
            p.requires_grad_(False)
    return model


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and in the reference
    if kind == "user_gpt":
        return UserGPT()
    if kind == "config_heads_gpt":
        from types import SimpleNamespace

        return UserGPT(config=SimpleNamespace(n_head=4))
    if kind == "blocked_qkv_gpt":
        return UserGPT(fused=True)
    if kind == "lightning_demo":  # Lightning's demos.Transformer (nn.Transformer inside)
        model = DemoTransformer(vocab_size=VOCAB, ninp=32, nhead=4, nhid=64, nlayers=2, dropout=0.0)
        for mha in (m for m in model.modules() if isinstance(m, nn.MultiheadAttention)):
            mha.in_proj_bias.requires_grad_(False)  # it holds the key bias (see build()); DDP alone: 1.5e-10
        return model
    if kind.startswith("litgpt"):  # litgpt's GPT: fused qkv [q | k | v], heads read from a shared config
        from litgpt import GPT as LitGPT
        from litgpt import Config as LitConfig

        # no biases: qkv's bias holds the key bias (see build()), which cannot be frozen on its own
        return LitGPT(
            LitConfig(
                block_size=SEQ,
                vocab_size=VOCAB,
                padded_vocab_size=VOCAB,
                n_layer=2,
                n_head=4,
                n_embd=32,
                n_query_groups=2 if kind == "litgpt_gqa" else 4,
                rotary_percentage=1.0,
                bias=False,
                mlp_class_name="LLaMAMLP" if kind == "litgpt_gqa" else "GptNeoxMLP",
                intermediate_size=64,
            )
        )
    if kind == "pack_gpt_tied":
        return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=16, mlp_ratio=2, tie_weights=True)
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
    )
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=4)
        return tf.LlamaForCausalLM(cfg)
    if kind in HF_2026:
        return HF_2026[kind](tf, common)
    if kind == "qwen2_gqa":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2))
    if kind == "gpt_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common, attention_bias=False))  # fused qkv bias: see build()
    if kind == "bloom_alibi":  # ALiBi biases built by the base model for every head
        cfg = tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0)
        return tf.BloomForCausalLM(cfg)
    assert kind == "gpt2_tied", kind
    cfg = tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(cfg)


# the models people bring now (tiny random configs): per-head q/k norms (Qwen3, Gemma 3), whole-projection q/k norms
# (OLMo 2), fused projections (Phi-3), mixtures of experts (Qwen3-MoE, Mixtral; experts eager: float64 on CPU)
HF_2026 = {
    "qwen3": lambda tf, c: tf.Qwen3ForCausalLM(tf.Qwen3Config(**c, num_key_value_heads=2, head_dim=8)),
    "gemma3": lambda tf, c: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(**c, num_key_value_heads=2, head_dim=8, sliding_window=4, final_logit_softcapping=None)
    ),
    "olmo2": lambda tf, c: tf.Olmo2ForCausalLM(tf.Olmo2Config(**c, num_key_value_heads=4, eos_token_id=0)),
    "phi3": lambda tf, c: tf.Phi3ForCausalLM(
        tf.Phi3Config(**c, num_key_value_heads=4, pad_token_id=0, eos_token_id=0, bos_token_id=0)
    ),
    "qwen3_moe": lambda tf, c: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(
            **c,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            experts_implementation="eager",
        )
    ),
    # fused [q | k | v] per kv group, parallel attention and MLP, `mlp_output += attention_output` in place
    "falcon": lambda tf, c: tf.FalconForCausalLM(
        tf.FalconConfig(
            **c, num_kv_heads=2, new_decoder_architecture=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0
        )
    ),
    "mixtral": lambda tf, c: tf.MixtralForCausalLM(
        tf.MixtralConfig(
            **c, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"
        )
    ),
}


def logits(model: nn.Module, x):
    if isinstance(model, DemoTransformer):  # demos.Transformer(inputs, target): log-probs [B * T, V]
        return model(x, x).view(*x.shape, -1)
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(0, VOCAB, (N, SEQ), generator=g))


def seq_len(step: int, crop: bool) -> int:
    """The sequence length of `step`: with `crop`, the first step's sequences are shorter (new sizes at step 1)."""
    return SEQ - 2 if crop and step % (N // GLOBAL_BATCH) == 0 else SEQ


class Task(pl.LightningModule):
    def __init__(self, kind: str, example: bool = True, crop: bool = False) -> None:
        super().__init__()
        self.model = build(kind)
        self.crop = crop
        if example:  # the TP strategy checks split vs unsplit output on it (else on made-up token ids)
            self.example_input_array = data().tensors[0][:2]

    def forward(self, x):
        return logits(self.model, x)

    def training_step(self, batch, batch_idx):
        x, y = (t[:, : seq_len(batch_idx, self.crop)] for t in batch)
        return F.cross_entropy(logits(self.model, x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(data(), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=GLOBAL_BATCH // kw["num_replicas"], sampler=sampler)


def reference(kind: str, steps: int = STEPS, crop: bool = False) -> dict:
    model = build(kind).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data()
    for k in range(steps):
        k %= N // GLOBAL_BATCH  # the next epoch sees the same batches (no shuffling)
        x, y = (t[:, : seq_len(k, crop)] for t in ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH])
        opt.zero_grad()
        F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def as_original(params: dict, ref: dict) -> dict:
    """Parameters in the reference's shapes: a fused [q | k | v] layer split per head (colwise_qkv, GPT-2's c_attn)
    is stored [in, 3, E], a view of its original [in, 3E] layout, so a reshape gives the original values exactly."""
    return {k: v.reshape(ref[k].shape) if k in ref else v for k, v in params.items()}


world = int(os.environ["WORLD_SIZE"])
import importlib.util  # noqa: E402

# litgpt (make test installs it without its pins: pip install --no-deps litgpt): its MHA GPT is one more model
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
mesh = {"tp": 2} if world == 2 else {"tp": 2, "dp_shard": 2, "dp_replicate": 1}
# argv[1]: the models to run (comma-separated), or "compile": only the compile section below
kinds = (
    []
    if sys.argv[1:2] == ["compile"]
    else sys.argv[1].split(",")
    if len(sys.argv) > 1
    else [
        "llama",
        "qwen2_gqa",
        "gpt2_tied",
        "gpt_neox",
        "user_gpt",
        "config_heads_gpt",
        "pack_gpt_tied",
        "lightning_demo",
        *HF_2026,
    ]
    + (["litgpt_mha"] if HAS_LITGPT else [])
)


def replicas_equal(module: nn.Module, group) -> bool:
    """Every parameter held whole on the tp ranks (a plain tensor, or a DTensor replicated on tp) is bitwise equal on
    each of them (its local part, under FSDP2: the same dp shard on every tp rank)."""
    from torch.distributed.tensor import DTensor, Replicate

    ok = True
    for _, p in module.named_parameters():
        if isinstance(p, DTensor):
            tp_dim = p.device_mesh.mesh_dim_names.index("tp") if "tp" in (p.device_mesh.mesh_dim_names or ()) else None
            if tp_dim is not None and not isinstance(p.placements[tp_dim], Replicate):
                continue  # split over tp: each rank holds its own part
            p = p.to_local()
        local = p.detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        ok &= all(torch.equal(g, gathered[0]) for g in gathered)
    return ok


def ddp_floor(kind: str, ref: dict) -> float:
    """Lightning's DDP on the same model, data and steps: the float64 distance a plain data-parallel run already has
    (models that compute parts in float32 inside, as Gemma 3's norms, have one above 1e-12)."""
    task = Task(kind)
    trainer("ddp", devices=world, steps=STEPS).fit(task)
    return max_rel_diff(full_params(task), ref)


for kind in kinds:
    ref = reference(kind)
    task = Task(kind)
    check = GradientParityCheck(steps=(0,), on_mismatch="warn")
    sp = len(sys.argv) > 2 and sys.argv[2] == "sp"  # by hand: sequence parallelism on every model
    t = trainer(
        TensorParallelStrategy(tp_plan="auto", sequence_parallel=sp, **mesh),
        devices=world,
        steps=STEPS,
        callbacks=[check],
    )
    t.fit(task)
    entries = t.strategy.tp_entries
    tied = shared_parameters(task)
    diff = max_rel_diff(as_original(full_params(task), ref), ref)
    same = replicas_equal(task, t.strategy.mesh.group("tp"))
    emit(
        kind="tp",
        model=kind,
        diff=diff,
        ddp_diff=ddp_floor(kind, ref) if diff > 1e-12 else None,
        replicas_equal=same,
        grad_parity=check.results[0]["rel_diff"],
        probe_diff=t.strategy.tp_probe_diff,
        self_check=t.strategy.self_check_report and vars(t.strategy.self_check_report),
        n_split=sum(e.style in ("colwise", "rowwise", "colwise_gather") for e in entries),
        styles=sorted({e.style for e in entries}),
        tied=tied,
        mesh=list(t.strategy.mesh.spec.shape),
    )

# torch.compile of every block under tp=2 (2 processes) and tp=2 x dp_shard=2 (4): a user GPT (q, k, v, o Linear,
# SDPA, nn.Sequential MLP) with no example_input_array (the probe runs made-up token ids of other sizes) whose first
# step's sequences are shorter (sizes change between steps: DTensor blocks compile with static shapes, since
# symbolic sizes made AOT autograd's backward trace exceed the recursion limit), and HF Llama
if not kinds or "user_gpt" in kinds:
    import time  # noqa: E402

    from lightning_dist.parallelize.units import select_units as _units  # noqa: E402

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the ranks share the test machine's cores
    for kind, example, crop in (("user_gpt", False, True), ("llama", True, False)):
        ref = reference(kind, crop=crop)
        task = Task(kind, example=example, crop=crop)
        start = time.perf_counter()
        t = trainer(TensorParallelStrategy(tp_plan="auto", compile=True, **mesh), devices=world, steps=STEPS)
        t.fit(task)
        blocks = [m for _, m in _units(task.model)]
        emit(
            kind="tp_compile",
            model=kind,
            diff=max_rel_diff(full_params(task), ref),
            mesh=list(t.strategy.mesh.spec.shape),
            compiled=[getattr(b, "_compiled_call_impl", None) is not None for b in blocks],
            probe_diff=t.strategy.tp_probe_diff,
            seconds=time.perf_counter() - start,
        )
if sys.argv[1:2] == ["compile"]:
    sys.exit(0)

if "gpt2_tied" in kinds:
    # GPT-2's c_attn split per head (colwise_qkv) through a sharded DCP checkpoint: a resumed run starts from the
    # saved weights exactly (the fused layers go through their state-dict hooks) with AdamW's state restored; the
    # checkpoint consolidated into one file loads into a plain single-device GPT2LMHeadModel with the original
    # [q | k | v] layout, bit for bit
    import tempfile  # noqa: E402
    from pathlib import Path  # noqa: E402

    from lightning.pytorch import Callback  # noqa: E402

    from lightning_dist.checkpoint import consolidate  # noqa: E402

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.params = full_params(pl_module)
            self.steps = sorted({float(s["step"]) for s in trainer.optimizers[0].state.values()})

    task = Task("gpt2_tied")
    t = trainer(TensorParallelStrategy(tp_plan="auto", **mesh), devices=world, steps=STEPS)
    t.fit(task)
    box = [Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    folder = box[0]
    fused = sorted(e.fqn for e in t.strategy.tp_entries if e.style == "colwise_qkv")
    ref = reference("gpt2_tied")
    stored = full_params(task)
    saved = as_original(stored, ref)
    t.save_checkpoint(folder / "ck")
    at_start = AtStart()
    trainer(TensorParallelStrategy(tp_plan="auto", **mesh), devices=world, steps=STEPS + 1, callbacks=[at_start]).fit(
        Task("gpt2_tied"), ckpt_path=folder / "ck"
    )
    row = {
        "fused": fused,
        "resume_loaded_diff": max((at_start.params[k] - v).abs().max().item() for k, v in stored.items()),
        "resume_adam_steps": at_start.steps,
        "stored_shapes": {k: list(v.shape) for k, v in stored.items() if k.endswith("attn.c_attn.weight")},
    }
    if dist.get_rank() == 0:
        consolidate(folder / "ck", folder / "single.ckpt")
        state = torch.load(folder / "single.ckpt", weights_only=True)["state_dict"]
        single = Task("gpt2_tied").double()
        single.load_state_dict(state)
        got = {n: p.detach() for n, p in single.named_parameters()}
        row["single_exact"] = got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
        row["single_shapes"] = {k: list(v.shape) for k, v in state.items() if k.endswith("attn.c_attn.weight")}
    emit(kind="fused_checkpoint", **row)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil  # noqa: E402

        shutil.rmtree(folder, ignore_errors=True)

if world == 2:
    # FSDP2 units of real models are their blocks: with ZeRO-2 one all-gather per block (and one per root) per step
    for kind in [k for k in kinds if k not in ("pack_gpt_tied", "config_heads_gpt")]:
        ref = reference(kind)
        task = Task(kind)
        ledger = CommunicationLedger(planned=None, log=False, print_table=False)
        t = trainer(FullyShardStrategy(zero_stage=2), devices=world, steps=STEPS, callbacks=[ledger])
        t.fit(task)
        gathers = [row["count"] for row in ledger.summary if row["op"] == "all_gather"]
        emit(
            kind="fsdp_units",
            model=kind,
            diff=max_rel_diff(full_params(task), ref),
            all_gathers=gathers,
            units=[n for n, _ in select_units(build(kind))],
            tied=shared_parameters(task),
        )

if world == 2:
    # a fused qkv laid out [q | k | v]: a contiguous split gives rank 0 all of q and half of k, and the model
    # trains silently wrong; the output probe (no example_input_array: made-up token ids) refuses it on every rank
    try:
        trainer(TensorParallelStrategy(tp_plan="auto", **mesh), devices=world, steps=STEPS).fit(
            Task("blocked_qkv_gpt", example=False)
        )
        emit(kind="refusal", model="blocked_qkv_gpt", error=None)
    except ValueError as err:
        emit(kind="refusal", model="blocked_qkv_gpt", error=str(err))

    # a bias the base model builds for every head (Bloom's ALiBi) meets each rank's heads: the split forward fails
    # where the unsplit one runs, refused on every rank naming the causes (not torch's bare shape error)
    try:
        trainer(TensorParallelStrategy(tp_plan="auto", **mesh), devices=world, steps=STEPS).fit(Task("bloom_alibi"))
        emit(kind="refusal", model="bloom_alibi", error=None)
    except ValueError as err:
        emit(kind="refusal", model="bloom_alibi", error=str(err))

if world == 2 and "qwen3" in kinds:
    # a plan that leaves Qwen3's per-head q/k norms whole without summing their gradients ('replicate': the split-flow
    # rule does not override a style the user wrote): the forward is right, the gradients are not; the setup
    # self-check refuses it on every rank before the first step, naming the norm
    planted = {f"model.layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
    planted |= {"model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.self_attn.q_norm": "replicate"}
    planted["model.layers.*.self_attn.k_norm"] = "replicate"
    task = Task("qwen3")
    try:
        trainer(TensorParallelStrategy(tp_plan=planted, **mesh), devices=world, steps=STEPS).fit(task)
        emit(kind="refusal", model="qwen3_planted", error=None)
    except ValueError as err:
        emit(kind="refusal", model="qwen3_planted", error=str(err), steps=task.global_step if task._trainer else None)

if world == 2 and HAS_LITGPT:
    # litgpt's GPT with grouped-query attention (n_query_groups=2 < n_head=4): its fused qkv [q | k | v] has unequal
    # blocks that no style of ours splits per head exactly: refused by tp_plan="auto" on every rank, before any
    # collective
    try:
        trainer(TensorParallelStrategy(tp_plan="auto", **mesh), devices=world, steps=1).fit(Task("litgpt_gqa"))
        emit(kind="refusal", model="litgpt_gqa", error=None)
    except ValueError as err:
        emit(kind="refusal", model="litgpt_gqa", error=str(err))

# HuggingFace folders (save_pretrained of tiny random models) loaded straight into the shards of a model built
# with its parameters on meta, and exported back: 2 processes: GPT-2 (tied) and Llama under tp=2 and fsdp2;
# 4 processes: Llama under tp=2 x dp_shard=2 (2-D DTensors). Loaded and exported weights equal the source.
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from lightning.pytorch import Callback  # noqa: E402

from lightning_dist.callbacks import HFPretrained  # noqa: E402
from lightning_dist.hf import init_empty_weights  # noqa: E402


class Loaded(Task):
    def __init__(self, folder: Path) -> None:
        import transformers as tf

        pl.LightningModule.__init__(self)
        self.crop = False  # Task.training_step reads it: full-length sequences
        with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) real
            self.model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(str(folder)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # one step that changes nothing: export == source


class Snapshot(Callback):
    """Whole parameters right after HFPretrained loaded them (callbacks run in their order)."""

    def on_fit_start(self, trainer, pl_module):
        self.params = full_params(pl_module)
        self.local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pl_module.parameters())


def hf_round_trip(root: Path, kind: str, label: str, strategy) -> None:
    import transformers as tf
    from safetensors.torch import load_file

    src_dir, out = root / f"src_{kind}", root / f"out_{kind}_{label}"
    snap = Snapshot()
    t = trainer(
        strategy, devices=world, steps=1, precision="32-true", callbacks=[HFPretrained(src_dir, export_to=out), snap]
    )
    t.fit(Loaded(src_dir))
    src = load_file(str(src_dir / "model.safetensors"))  # a tied head is stored once, as the embedding
    row = {
        "model": kind,
        "strategy": label,
        "mesh": list(t.strategy.mesh.spec.shape),
        "local_numel": snap.local,
        "total_numel": sum(v.numel() for v in snap.params.values()),
        "loaded_diff": max((snap.params[f"model.{k}"].reshape(v.shape) - v).abs().max().item() for k, v in src.items()),
    }
    if dist.get_rank() == 0:
        back = tf.AutoModelForCausalLM.from_pretrained(str(out))
        sd = back.state_dict()
        row["export_diff"] = max((sd[k] - v).abs().max().item() for k, v in src.items())
        row["export_tied"] = kind != "gpt2_tied" or back.lm_head.weight is back.transformer.wte.weight
    emit(kind="hf_weights", **row)


box = [Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
dist.broadcast_object_list(box, 0)
hf_root = box[0]
hf_kinds = ["gpt2_tied", "llama"] if world == 2 else ["llama"]
if dist.get_rank() == 0:
    for kind in hf_kinds:
        build(kind).save_pretrained(str(hf_root / f"src_{kind}"))
dist.barrier()
for kind in hf_kinds:
    if world == 2:
        hf_round_trip(hf_root, kind, "tp2", TensorParallelStrategy(tp_plan="auto", **mesh))
        hf_round_trip(hf_root, kind, "fsdp2", FullyShardStrategy())
    else:
        hf_round_trip(hf_root, kind, "tp2_dp_shard2", TensorParallelStrategy(tp_plan="auto", **mesh))
dist.barrier()
if dist.get_rank() == 0:
    shutil.rmtree(hf_root, ignore_errors=True)
