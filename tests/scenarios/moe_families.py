"""Three more mixture-of-experts families against one device on the global batch, float64: unmodified HF DeepSeek-V3
(multi-head latent attention, sigmoid routing with group-limited top-k and a correction bias, a shared expert, the
first layer dense), gpt-oss (experts with biases, clamped SwiGLU, attention sinks, a sliding window) and Ergo (each
expert's norm scale held by a child of the experts module; fsdp2 and ep2 only).

Tiny random configs (vocab 64, hidden 32, 2 layers, experts run eagerly). gpt-oss has transformers' Switch router loss
(``output_router_logits=True``, ``router_aux_loss_coef=0.05``): the loss adds it, as ``moe_parity.py`` does.
DeepSeek-V3 has none in transformers (no ``load_balancing_loss_func``, no ``aux_loss`` on its output; its correction
bias is updated outside the loss by the original recipe): the loss is the cross-entropy alone.

``torchrun --nproc-per-node 2 moe_families.py``: fsdp2 (dp_shard=2), ep=2 and tp=2 (``tp_plan="auto"``), plus gpt-oss
with the per-rank router loss (must differ) and under the pack's transformer plan (sinks: refused), and DeepSeek-V3
under two plans by hand (latent heads split: refused; MLPs split). Each case either equals one device (the max
relative parameter difference after 3 AdamW steps) or is refused with a ValueError before any collective. DeepSeek-V3's
router runs in float32, so its data-parallel runs are also held to one device on the ranks' split of the batch
(``split_diff``; ``float32_router``: how far that one device is from itself on the whole batch).
One RESULT row per model and case and rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _common import emit_gathered as emit
from _common import full_params, max_rel_diff, trainer
from moe_parity import COEF, GLOBAL_BATCH, STEPS, VOCAB, Task, data, ep_degree

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.strategies import FullyShardStrategy, TensorParallelStrategy

MODELS = ("deepseek_v3", "gpt_oss", "ergo")
ATTN, DENSE, SHARED = "model.model.layers.*.self_attn.", "model.model.layers.0.mlp.", "model.model.layers.1.mlp.shared_"
CASES = {  # case -> (models, strategy)
    "fsdp2": (MODELS, lambda: FullyShardStrategy()),
    "ep2": (MODELS, lambda: FullyShardStrategy(ep=2)),
    "tp2": (MODELS[:2], lambda: TensorParallelStrategy(tp=2)),  # tp_plan="auto"
    # gpt-oss: the router loss per rank on purpose, which must differ (so the exact path's test can fail)
    "fsdp2_local": (("gpt_oss",), lambda: FullyShardStrategy(moe_aux_loss="local")),
    # plans written by hand: latent attention's heads split (its shared rotary key joins them: refused), the dense
    # and shared-expert MLPs split (exact); gpt-oss's attention split by the pack's transformer plan (sinks: refused)
    "tp2_mla_heads": (
        ("deepseek_v3",),
        lambda: TensorParallelStrategy(
            tp=2, tp_plan={ATTN + "q_b_proj": "colwise", ATTN + "kv_b_proj": "colwise", ATTN + "o_proj": "rowwise"}
        ),
    ),
    "tp2_mlp": (
        ("deepseek_v3",),
        lambda: TensorParallelStrategy(
            tp=2,
            tp_plan={
                **{p + "gate_proj": "colwise" for p in (DENSE, SHARED + "experts.")},
                **{p + "up_proj": "colwise" for p in (DENSE, SHARED + "experts.")},
                **{p + "down_proj": "rowwise" for p in (DENSE, SHARED + "experts.")},
            },
        ),
    ),
    "tp2_transformer": (("gpt_oss",), lambda: TensorParallelStrategy(tp=2, tp_plan="transformer")),
}


def build(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        experts_implementation="eager",
    )
    if kind == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,  # group-limited: the top 2 of 4 groups of 2 experts, then the top 2 experts among them
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 a mixture of experts
            routed_scaling_factor=2.5,
            q_lora_rank=16,  # latent query and key-value projections
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model = tf.DeepseekV3ForCausalLM(cfg).double()
        g = torch.Generator().manual_seed(2)
        for mod in model.modules():  # a non-zero correction bias (trained checkpoints have one), a router not zero
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.1 * torch.randn(mod.num_experts, generator=g))
        return model
    if kind == "ergo":  # each expert scales its output by a norm of its own, held by a child of the experts module
        cfg = tf.AutoConfig.for_model(
            "ergo",
            **{k: v for k, v in common.items() if k != "experts_implementation"},
            num_key_value_heads=2,
            num_dense_blocks=1,  # layer 0 dense, layer 1 a mixture of experts
            first_dense_intermediate_size=32,
            moe_intermediate_size=16,
            shared_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        )
        model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").double()
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # the per-expert norm scales differ, so an expert given another's scale shows
            for name, p in model.named_parameters():
                if "post_expert_norm" in name:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        return model
    assert kind == "gpt_oss", kind
    cfg = tf.GptOssConfig(
        **common,
        intermediate_size=16,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,  # layer 0 sliding, layer 1 full
        layer_types=["sliding_attention", "full_attention"],
        output_router_logits=True,
        router_aux_loss_coef=COEF,
    )
    model = tf.GptOssForCausalLM(cfg).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # sinks and expert biases non-zero, so they matter to the forward
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias", "router.bias")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def step_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    aux = getattr(out, "aux_loss", None)
    return loss if aux is None else loss + COEF * aux


class FamilyTask(Task):
    def __init__(self, kind: str) -> None:
        pl.LightningModule.__init__(self)  # Task's own __init__ builds moe_parity's models
        self.model = build(kind)
        self.example_input_array = data().tensors[0][:2]

    def training_step(self, batch, batch_idx):
        return step_loss(self.model, *batch)


def reference(kind: str, parts: int = 1) -> dict:
    """One device on the global batch; `parts` > 1: its gradient accumulated over the tokens of each of `parts`
    data-parallel ranks (rank r: samples r, r + parts, ... of the batch, as the non-shuffling sampler deals them)."""
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ds = data()
    for k in range(STEPS):
        x, y = ds[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        for r in range(parts):
            (step_loss(model, x[r::parts], y[r::parts]) / parts).backward()
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    for kind in MODELS:
        ref = reference(kind)
        # DeepSeek-V3's router runs in float32 whatever the model's dtype: one device differs from itself by ~1e-8
        # between two splits of the batch, so the data-parallel runs are also held to one device on the ranks' split
        split = reference(kind, parts=2) if kind in ("deepseek_v3", "ergo") else None
        aux = getattr(build(kind).config, "output_router_logits", False)
        for case, (models, make) in CASES.items():
            if kind not in models:
                continue
            task = FamilyTask(kind)
            row = dict(kind="family", model=kind, case=case, router_loss=aux, error=None)
            try:
                strategy = make()
                trainer(strategy, devices=2, steps=STEPS).fit(task)
                params = full_params(task)
                check = getattr(strategy, "ep_check_report", None)  # the ep self-check's figures (None: it did not run)
                row.update(
                    diff=max_rel_diff(params, ref),
                    split_diff=None if split is None else max_rel_diff(params, split),
                    ep=ep_degree(task),
                    ep_check=None if check is None else {"modules": check.blocks, "worst": check.worst},
                )
            except ValueError as err:  # a refusal: before any collective, on every rank
                row.update(error=str(err))
            emit(**row)
        if split is not None:
            emit(kind="float32_router", model=kind, split_vs_global=max_rel_diff(split, ref))


if __name__ == "__main__":
    main()
