"""The pack's mixture-of-experts layers and its router load-balancing loss (one process)."""

import pytest
import torch
import torch.nn.functional as F
from _harness import tiny_qwen3_moe

from lightning_dist.models import MoE, MoEGPT
from lightning_dist.parallelize.moe import RouterStats, balance_loss


@pytest.mark.parametrize("router,n_shared", [("softmax", 0), ("sigmoid", 1)])
def test_moe_is_the_weighted_sum_of_each_tokens_chosen_experts(router, n_shared):
    torch.manual_seed(0)
    moe = MoE(dim=8, n_experts=6, top_k=2, hidden=4, n_shared=n_shared, router=router).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    flat = x.reshape(-1, 8)
    chosen, weights, probs = moe.route(flat)
    assert torch.allclose(weights.sum(-1), torch.ones(15, dtype=torch.float64))  # the chosen weights sum to one
    expected = torch.stack(
        [
            sum(w * moe.experts.expert(int(e), t[None])[0] for e, w in zip(c, ws))
            + (moe.shared(t[None])[0] if n_shared else 0)
            for t, c, ws in zip(flat, chosen, weights)
        ]
    )
    assert torch.allclose(moe(x).reshape(-1, 8), expected, atol=1e-12)
    logits = moe.router(flat)
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    assert torch.equal(chosen, scores.topk(2, dim=-1).indices)


def test_balance_loss_is_the_switch_loss_and_pipelines_are_refused():
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=4, top_k=2, expert_hidden=4)
    model(torch.randint(0, 16, (2, 8)))
    expected = 0.0
    for block in model.blocks:
        s = block.mlp.stats
        expected += 4 * torch.sum((s.counts / s.rows) * (s.probs / s.rows))
    assert torch.allclose(model.aux_loss(), expected)
    # two halves of a batch do not give the whole batch's loss as the mean of theirs (why it is reduced over dp)
    probs = F.softmax(torch.randn(8, 4, dtype=torch.float64), -1)
    chosen = probs.topk(2, dim=-1).indices
    whole = balance_loss(RouterStats.of(chosen, probs, 4))
    halves = [balance_loss(RouterStats.of(chosen[i : i + 4], probs[i : i + 4], 4)) for i in (0, 4)]
    assert not torch.allclose(whole, sum(halves) / 2)
    model.blocks = model.blocks[:1]  # a pipeline stage holds some blocks
    with pytest.raises(RuntimeError, match="pipeline stage: it holds 1 of the 2 blocks"):
        model.aux_loss()


def test_expert_parallel_configuration_is_checked_before_any_collective():
    from lightning_dist.models import GPT
    from lightning_dist.parallelize.ep import ep_problems, find_experts
    from lightning_dist.strategies import FullyShardStrategy

    moe = MoEGPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, n_experts=6, top_k=2, expert_hidden=4)
    assert [n for n, _ in find_experts(moe)] == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]  # not the router
    assert ep_problems(moe, ep=2, dp_shard=4) == []
    (problem,) = ep_problems(moe, ep=3, dp_shard=4)[:1]
    assert "ep=3 must divide dp_shard=4" in problem
    assert any("holds 6 experts, not divisible by ep=4" in p for p in ep_problems(moe, ep=4, dp_shard=4))
    # with tp: an ep group takes every tp rank (ep a multiple of tp) or lies inside dp_shard at each tp coordinate
    assert ep_problems(moe, ep=2, dp_shard=1, tp=2) == [] and ep_problems(moe, ep=6, dp_shard=3, tp=2) == []
    assert ep_problems(moe, ep=2, dp_shard=2, tp=4) == []
    (problem,) = ep_problems(moe, ep=6, dp_shard=2, tp=2)
    assert "ep=6 with tp=2 and dp_shard=2" in problem and "ep / tp dividing 2" in problem, problem
    dense = GPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    assert any("has no experts module" in p for p in ep_problems(dense, ep=2, dp_shard=2))

    class MaskEmbedding(torch.nn.Module):  # XLNet's base model: one [1, 1, d] parameter of its own, a wide forward
        def __init__(self):
            super().__init__()
            self.mask_emb = torch.nn.Parameter(torch.zeros(1, 1, 8))

        def forward(self, input_ids, attention_mask=None, mems=None):
            return input_ids

    # was "holds 1 experts, not divisible by ep=2"
    assert any("has no experts module" in p for p in ep_problems(MaskEmbedding(), ep=2, dp_shard=2))
    with pytest.raises(ValueError, match="zero_stage=1 replicates parameters instead"):
        FullyShardStrategy(ep=2, zero_stage=1)
    with pytest.raises(ValueError, match=r"`ep=0` must be an integer >= 1"):
        FullyShardStrategy(ep=0)


def test_hf_experts_are_found_by_their_interface():
    transformers = pytest.importorskip("transformers")
    from lightning_dist.parallelize.ep import expert_count, find_experts

    found = find_experts(tiny_qwen3_moe(transformers))
    assert [n for n, _ in found] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(expert_count(m) == 4 for _, m in found)


def test_grouped_mm_where_torch_does_not_serve_the_dtype_is_refused_at_set_up():
    """transformers' default experts kernel (grouped_mm) fails deep inside torch in float64 on CPU: the strategy refuses
    it in check_model (every strategy, every rank, before any collective), naming the module, the dtype and the fix."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import DoublePrecision

    from lightning_dist._integrations.transformers_moe import grouped_mm_problems
    from lightning_dist.strategies import FullyShardStrategy, PipelineStrategy

    def qwen(**kw):
        return tiny_qwen3_moe(transformers, **kw)

    class Task(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

    cpu = torch.device("cpu")
    default = qwen()  # transformers picks grouped_mm by default
    with pytest.raises(RuntimeError, match="Double"):  # what the user would meet without the check
        default.double()(torch.randint(0, 32, (1, 4)))
    (problem,) = grouped_mm_problems(default, dtype=torch.float64, device=cpu)
    for part in (
        "model.layers.0.mlp.experts (Qwen3MoeExperts) and 1 more",
        "torch.float64 on cpu",
        'experts_implementation="eager"',
    ):
        assert part in problem, problem
    assert grouped_mm_problems(default, dtype=None, device=cpu)  # the model's own dtype (float64 since .double())
    assert grouped_mm_problems(default, dtype=torch.float32, device=cpu) == []  # served: nothing refused
    eager = qwen(experts_implementation="eager").double()
    assert grouped_mm_problems(eager, dtype=torch.float64, device=cpu) == []
    eager(torch.randint(0, 32, (1, 4)))  # and it runs
    # through the strategy: the precision decides the dtype ("64-true" converts a float32 model at set-up)
    strategy = FullyShardStrategy()
    strategy.parallel_devices = [cpu] * 2
    strategy.connect(Task(qwen().float()))
    strategy.check_model()  # "32-true": float32, served
    strategy.precision_plugin = DoublePrecision()
    with pytest.raises(ValueError, match=r"model\.model\.layers\.0\.mlp\.experts .*torch\.float64 on cpu"):
        strategy.check_model()
    # every strategy, not only the sharded ones: a pipeline of the same model
    pipeline = PipelineStrategy(pp=2)
    pipeline.parallel_devices = [cpu] * 2
    pipeline.connect(Task(qwen().double()))
    with pytest.raises(ValueError, match=r"experts_implementation=\"eager\""):
        pipeline.check_model()


def test_ep_capacity_factor_is_an_explicit_option_that_needs_ep():
    from lightning_dist.parallelize.ep import capacity_keep, expert_capacity
    from lightning_dist.strategies import FullyShardStrategy

    assert FullyShardStrategy(ep=2).model_options.ep_capacity_factor is None  # dropless unless asked
    assert FullyShardStrategy(ep=2, ep_capacity_factor=1.25).model_options.ep_capacity_factor == 1.25
    with pytest.raises(ValueError, match=r"`ep_capacity_factor=1.5` drops tokens in expert parallelism's dispatch"):
        FullyShardStrategy(ep_capacity_factor=1.5)
    for bad in (0, -1.0, "1.5", True):
        with pytest.raises(ValueError, match=r"must be a number > 0"):
            FullyShardStrategy(ep=2, ep_capacity_factor=bad)
    assert expert_capacity(1.0, 12, 4) == 3 and expert_capacity(1.25, 12, 4) == 4 and expert_capacity(0.1, 12, 4) == 1
    # pairs sorted by expert (token order within each): each expert keeps its first `capacity`
    experts = torch.tensor([0, 0, 0, 1, 3, 3])
    keep = capacity_keep(experts, torch.bincount(experts, minlength=4), 2)
    assert keep.tolist() == [True, True, False, True, True, True]


_CAPACITY_IN_ONE_GROUP = r"""
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from lightning_dist.models.moe import Experts
from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY, apply_ep, dropless

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
whole = Experts(n=4, dim=8, hidden=6).double()
x = torch.randn(10, 8, dtype=torch.float64)
index = torch.tensor([[0, 1]] * 6 + [[1, 2]] * 2 + [[3, 0]] * 2)  # expert 0: 8 pairs, 1: 8, 2: 2, 3: 2
weights = torch.rand(10, 2, dtype=torch.float64)
holder = torch.nn.Module()
holder.experts = Experts(n=4, dim=8, hidden=6).double()
holder.experts.load_state_dict(whole.state_dict())
apply_ep(holder, init_device_mesh("cpu", (1,)), capacity_factor=1.0)  # capacity ceil(20 / 4) = 5 pairs per expert
got = holder.experts(x, index, weights)
state = holder.experts.__dict__[GLOBAL_EXPERTS_KEY]
# the reference: the whole module with the weight of each expert's pairs past its first 5 (token order) set to 0
kept = weights.clone()
for e in range(4):
    rows, slot = (index == e).nonzero(as_tuple=True)
    kept[rows[5:], slot[5:]] = 0.0
want = whole(x, index, kept)
assert state["dropped"] == 6, state["dropped"]
close = lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-14)  # float64 round-off (other rows per matmul)
assert close(got, want), (got - want).abs().max()
assert not close(got, whole(x, index, weights))  # dropping changed the output
with dropless([holder.experts]):  # the self-check's block: nothing dropped
    assert close(holder.experts(x, index, weights), whole(x, index, weights))
# experts as grouped GEMMs (float32) under the dispatch: the rows arrive by source rank, not sorted by expert
from lightning_dist._compat import grouped_mm_refusal
if grouped_mm_refusal(torch.float32, "cpu") is None:
    loop = Experts(n=4, dim=8, hidden=12)
    holder.experts = Experts(n=4, dim=8, hidden=12, grouped=True)
    holder.experts.load_state_dict(loop.state_dict())
    apply_ep(holder, init_device_mesh("cpu", (1,)))
    got, want = holder.experts(x.float(), index, weights.float()), loop(x.float(), index, weights.float())
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
print("OK")
"""


def test_ep_capacity_factor_drops_each_experts_pairs_past_its_capacity_in_token_order():
    import subprocess
    import sys

    from tests._harness import free_port

    out = subprocess.run(
        [sys.executable, "-c", _CAPACITY_IN_ONE_GROUP, str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_experts_as_grouped_gemms_equal_the_per_expert_loop_forward_and_backward():
    from lightning_dist._compat import grouped_mm_refusal
    from lightning_dist.models.moe import Experts

    refusal = grouped_mm_refusal(torch.float32, "cpu")
    if refusal is not None:
        pytest.skip(f"torch's grouped GEMM does not run float32 on this CPU: {refusal}")
    assert grouped_mm_refusal(torch.float64, "cpu") is not None  # float64: the loop (what every parity test runs)
    torch.manual_seed(0)
    loop = Experts(n=4, dim=8, hidden=12)
    grouped = Experts(n=4, dim=8, hidden=12, grouped=True)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(10, 8)
    index = torch.tensor([[0, 1]] * 6 + [[1, 2]] * 4)  # expert 3 gets no row: an empty group
    weights = torch.rand(10, 2)
    grad = torch.randn(10, 8)
    outs = []
    for m in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = m(xi, index, weights)
        out.backward(grad)
        outs.append((out, xi.grad, m.gate_up.grad, m.down.grad))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert not loop._use_grouped(x) and Experts(n=4, dim=8, hidden=12)._use_grouped(x) is False  # CPU: the loop
    with pytest.raises(ValueError, match=r"grouped=True.*float64 on cpu"):
        grouped.double()(x.double(), index, weights.double())
    with pytest.raises(ValueError, match=r"widths \(8, 6\) unaligned"):  # 6 float32 = 24 bytes a row
        Experts(n=4, dim=8, hidden=6, grouped=True)(x, index, weights)
    with pytest.raises(TypeError, match="grouped='yes' must be True, False or None"):
        Experts(n=4, dim=8, hidden=6, grouped="yes")
    model = MoEGPT(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, expert_hidden=4, grouped_experts=True)
    assert all(b.mlp.experts.grouped is True for b in model.blocks)
