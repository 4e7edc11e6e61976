"""Two mixture-of-experts families, one process: gpt-oss's experts with per-expert biases are found by expert
parallelism, and tensor-parallel plans that split heads next to a shared activation (DeepSeek-V3's latent rotary key)
or a per-head parameter (gpt-oss's sinks) are refused for the right reason. Parity: tests/distributed/
test_moe_families.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class _BiasedExperts(nn.Module):
    """Experts as gpt-oss holds them: 3-D weights and 2-D per-expert biases, all with the expert first."""

    def __init__(self, experts: int = 4, dim: int = 8, hidden: int = 6) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, dim, hidden))
        self.up_bias = nn.Parameter(torch.randn(experts, hidden))
        self.down = nn.Parameter(torch.randn(experts, hidden, dim))
        self.down_bias = nn.Parameter(torch.randn(experts, dim))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for j in range(top_k_index.shape[1]):
            e = top_k_index[:, j]
            h = torch.relu(torch.einsum("nd,ndh->nh", hidden, self.up[e]) + self.up_bias[e])
            y = torch.einsum("nh,nhd->nd", h, self.down[e]) + self.down_bias[e]
            out = out + y * top_k_weights[:, j : j + 1]
        return out


class _TableOnly(nn.Module):
    """[E, C] parameters only (a router's weight, an embedding table) with a 3-argument forward: not experts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.bias = nn.Parameter(torch.randn(4, 3))

    def forward(self, hidden, top_k_index, top_k_weights):
        return hidden


def test_experts_with_per_expert_biases_are_found():
    from lightning_dist.parallelize.ep import ep_problems, expert_count

    assert expert_count(_BiasedExperts()) == 4
    assert expert_count(_TableOnly()) is None  # no 3-D weight: not an experts module
    net = nn.ModuleDict({"experts": _BiasedExperts()})
    assert ep_problems(net, ep=2, dp_shard=2) == []


def _tiny_gpt_oss(tf):
    cfg = tf.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        experts_implementation="eager",
    )
    return tf.GptOssForCausalLM(cfg)


def test_gpt_oss_experts_are_found_by_expert_parallelism():
    tf = pytest.importorskip("transformers")
    from lightning_dist.parallelize.ep import ep_problems, find_experts

    model = _tiny_gpt_oss(tf)
    assert [n for n, _ in find_experts(model)] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert ep_problems(model, ep=2, dp_shard=2) == []  # was: "has no experts module" (2-D biases refused)


def test_gpt_oss_sinks_refuse_a_plan_that_splits_its_heads():
    tf = pytest.importorskip("transformers")
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    model = _tiny_gpt_oss(tf)
    model.example_input_array = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match=r"self_attn \(GptOssAttention\) is a region the plan splits.*'sinks'"):
        resolve_tp_plan(model, "transformer", tp=2)


class _SharedKeyAttention(nn.Module):
    """Heads split by q/kv (column-wise) and o (row-wise), joined by a key part every head shares, computed by a layer
    left whole (multi-head latent attention's rotary key)."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.shared = nn.Linear(dim, dim // heads)

    def forward(self, x):
        B, T, D = x.shape
        q = self.q(x).view(B, T, -1, D // self.heads)
        k, v = self.kv(x).view(B, T, -1, 2 * D // self.heads).chunk(2, dim=-1)
        k = k + self.shared(x).unsqueeze(2)  # one key part for every head
        y = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class _TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_SharedKeyAttention() for _ in range(2))
        self.example_input_array = torch.randint(0, 32, (2, 4))  # token ids: every activation comes from the table

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_split_flow_names_a_shared_key_joining_split_heads_of_a_token_model():
    """Activations of a token-id model are not 'computed from parameters alone' (the ids are data): a shared key
    joining the split heads is named as such, not as the embedding table 'running on the split output'."""
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    plan = {"layers.*.q": "colwise", "layers.*.kv": "colwise", "layers.*.o": "rowwise"}
    with pytest.raises(ValueError) as err:
        resolve_tp_plan(_TokenNet(), plan, tp=2)
    message = str(err.value)
    assert "layers.0.kv -> add: a (2, 4, 1, 4) activation computed without it joins the split activation" in message
    assert "embed" not in message, message


def test_split_flow_names_deepseek_v3_latent_rotary_key():
    tf = pytest.importorskip("transformers")
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    cfg = tf.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_mtp_layers=0,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        experts_implementation="eager",
    )
    model = tf.DeepseekV3ForCausalLM(cfg)
    model.example_input_array = torch.randint(0, 64, (2, 8))
    attn = "model.layers.*.self_attn."
    plan = {attn + "q_b_proj": "colwise", attn + "kv_b_proj": "colwise", attn + "o_proj": "rowwise"}
    with pytest.raises(ValueError) as err:
        resolve_tp_plan(model, plan, tp=2)
    message = str(err.value)
    assert "model.layers.1.self_attn.kv_b_proj -> copy_" in message and "rotary key" in message, message
    assert "embed_tokens" not in message, message  # was: "embed_tokens (Embedding) runs on the output of kv_b_proj"
