"""Context parallelism in one process: the load-balanced split, the refusals and their messages, the pack's GPT
positions. The exchange itself (all-to-all, parity with single-device training) is in
tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dist.mesh import MeshSpec
from lightning_dist.models import GPT
from lightning_dist.parallelize.cp import ContextParallel, CPGroup, cp_model_problems, cp_style_problems, find_network
from lightning_dist.parallelize.pipeline.hf import hf_labels_loss
from lightning_dist.parallelize.pipeline.split import network_layout
from lightning_dist.rules import cp_chunks, replicates
from lightning_dist.strategies import HybridShardStrategy, MeshStrategy, PipelineStrategy
from lightning_dist.strategies.pipeline.step import cp_share, cut_for_cp, cut_target


def test_chunks_balance_causal_work_and_cover_the_sequence():
    assert cp_chunks(16, 2, 0) == [(0, 4), (12, 16)]
    assert cp_chunks(16, 2, 1) == [(4, 8), (8, 12)]
    cover = sorted(p for r in range(4) for a, b in cp_chunks(32, 4, r) for p in range(a, b))
    assert cover == list(range(32))
    # causal work of a chunk ~ its end position: every rank gets the same total
    work = [sum(b for _, b in cp_chunks(32, 4, r)) for r in range(4)]
    assert len(set(work)) == 1


def test_odd_sequence_is_refused_with_the_multiple():
    with pytest.raises(ValueError, match=r"sequence length 10 does not divide into 2 x cp = 4 .* multiple of 4"):
        cp_chunks(10, 2, 0)


def test_cp_always_shards_with_fsdp2():
    assert replicates(zero_stage=3, dp_shard=1, tp=1) is True
    assert replicates(zero_stage=3, dp_shard=1, tp=1, cp=2) is False


def test_ring_runs_on_cpu_and_cuda_and_is_refused_elsewhere_naming_ulysses():
    assert cp_style_problems("ring", 2, "cpu") == [] and cp_style_problems("ring", 2, "cuda") == []
    (msg,) = cp_style_problems("ring", 2, "mps")
    assert "'mps'" in msg and "cp_style='ulysses'" in msg
    (msg,) = cp_style_problems("zigzag", 2)
    assert "`cp_style='zigzag'` must be one of" in msg
    assert cp_style_problems("ulysses", 2, "cpu") == []


def test_strategy_options_are_checked_at_construction():
    with pytest.raises(ValueError, match=r"`cp=0` must be an integer >= 1"):
        HybridShardStrategy(cp=0)
    assert HybridShardStrategy(cp=2, cp_style="ring").cp_style == "ring"
    assert "cp=2" in repr(HybridShardStrategy(cp=2))


def test_heads_not_divisible_by_cp_are_refused():
    net = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_embd=16)
    (msg,) = cp_model_problems(net, cp=8)
    assert "4 attention heads do not divide over cp=8" in msg and "Pick cp dividing 4" in msg
    (msg,) = cp_model_problems(net, cp=4, tp=2)
    assert "per tensor-parallel rank (4 / tp=2)" in msg and "Pick cp dividing 2" in msg
    assert cp_model_problems(net, cp=2, tp=2) == []
    # fewer key/value heads than cp: repeated to one per query head, not refused
    assert cp_model_problems(GPT(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_kv_head=1, n_embd=16), cp=4) == []


def test_models_cp_cannot_split_are_refused():
    class NoPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)

        def forward(self, idx):
            return self.emb(idx)

    (msg,) = cp_model_problems(NoPositions(), cp=2)
    assert "takes no `position_ids`" in msg and "cp=1" in msg

    class WithMHA(NoPositions):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2)

        def forward(self, idx, position_ids=None):
            return self.emb(idx)

    (msg,) = cp_model_problems(WithMHA(), cp=2)
    assert "nn.MultiheadAttention" in msg


def test_hf_sliding_window_is_refused():
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    problems = cp_model_problems(tf.Qwen2ForCausalLM(cfg), cp=2)
    assert any("other than full causal attention (['sliding_attention']: sliding windows" in p for p in problems)
    llama = tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    assert cp_model_problems(llama, cp=2) == [] and cp_model_problems(llama, cp=8)
    # a multimodal model (AutoModelForCausalLM of a Gemma 4 checkpoint) holds its layer types in its text config: read
    # there (before 2026-12-06 it was missed at setup, and only the mask builder refused a window at the first step)
    text = dict(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    mm = tf.Gemma3Config(text_config=text)
    assert not hasattr(mm, "layer_types") or not getattr(mm, "layer_types", None)

    class Multimodal(nn.Module):
        config = mm

        def forward(self, input_ids, position_ids=None):
            return input_ids

    problems = cp_model_problems(Multimodal(), cp=2)
    assert any("(['full_attention', 'sliding_attention']: sliding windows" in p for p in problems), problems


def test_a_mask_the_builder_cannot_report_is_refused(monkeypatch):
    """The mask checks under cp read transformers' mask-builder arguments (`q_length`, `local_size`, `use_vmap`): where
    a release does not pass them, HF models are refused rather than trained with a mask cp would drop."""
    tf = pytest.importorskip("transformers")
    from lightning_dist import _compat
    from lightning_dist.parallelize.cp import _use_hf_attention

    assert _compat.hf_mask_builder_reports_mask()  # the transformers installed here reports them
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    monkeypatch.setattr(_compat, "hf_mask_builder_reports_mask", lambda: False)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: this transformers release's mask builder.*or cp=1"):
        _use_hf_attention(llama, cp=2)
    monkeypatch.undo()
    assert _use_hf_attention(llama, cp=2) in ("sdpa", "eager")


def _hf_small(tf, cls, config, **extra):
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    return cls(config(**small, num_key_value_heads=2, head_dim=4, **extra)).double()


def test_a_window_mask_no_layer_uses_is_not_refused():
    """Qwen2-MoE builds a sliding-window mask (window 0 without `use_sliding_window`) whatever its layer types: with
    every layer full attention nothing uses it, so cp trains the model (refused at the first forward before); a
    window every layer keeps (HF Mistral: no layer types) is still refused."""
    tf = pytest.importorskip("transformers")
    from transformers.masking_utils import create_sliding_window_causal_mask

    moe = _hf_small(tf, tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig, num_experts=4, moe_intermediate_size=8)
    assert moe.config.sliding_window == 0 and set(moe.config.layer_types) == {"full_attention"}
    mistral = _hf_small(tf, tf.MistralForCausalLM, tf.MistralConfig, sliding_window=4)
    embeds = torch.zeros(2, 4, 16, dtype=torch.float64)
    for net in (moe, mistral):
        state = ContextParallel(CPGroup(2, 0, None))
        state.attach(net)
        positions = state.cp.positions(8, "cpu").expand(2, -1)
        if net is moe:
            assert create_sliding_window_causal_mask(net.config, embeds, None, None, position_ids=positions) is None
        else:
            with pytest.raises(ValueError, match="sliding window of 4 tokens and the sequences have 8"):
                create_sliding_window_causal_mask(net.config, embeds, None, None, position_ids=positions)
        state.detach()


def test_the_models_own_mask_terms_are_refused_on_every_rank():
    """A model that composes its own terms into the causal mask (transformers' or/and mask functions) would lose them
    under cp, which runs one causal (or full) attention over the whole sequence: refused in the mask builder, on every
    cp rank alike (before the first attention exchange). Without such terms the builder gives no mask, also on the
    ranks whose load-balanced positions jump (transformers reads those as packed sequences)."""
    tf = pytest.importorskip("transformers")
    from transformers.masking_utils import create_causal_mask

    net = _hf_small(tf, tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, layer_types=["full_attention"] * 2)
    net.config.use_bidirectional_attention = True  # the embedding-model form: a full-mask `or_mask_function`
    net.train()
    x = torch.randint(0, 32, (2, 8))
    for rank in (0, 1):
        state = ContextParallel(CPGroup(2, rank, None))  # no group: the refusal comes before any exchange
        state.attach(net)
        assert cp_model_problems(net, cp=2) == []  # nothing at setup tells it apart
        with pytest.raises(ValueError, match=r"own terms to the causal attention mask.*Use cp=1 for this model"):
            net(x, use_cache=False)
        state.detach()
    llama = _hf_small(tf, tf.LlamaForCausalLM, tf.LlamaConfig)
    state = ContextParallel(CPGroup(2, 0, None))
    state.attach(llama)
    embeds = torch.zeros(2, 4, 16, dtype=torch.float64)
    positions = state.cp.positions(8, "cpu").expand(2, -1)  # rank 0 of cp=2: positions 0, 1, 6, 7
    assert create_causal_mask(llama.config, embeds, None, None, position_ids=positions) is None
    with pytest.raises(ValueError, match="own terms to the causal attention mask"):
        create_causal_mask(llama.config, embeds, None, None, position_ids=positions, and_mask_function=lambda *a: True)
    state.detach()
    assert llama.config._attn_implementation == "sdpa"


def test_packed_position_ids_are_refused_for_hf_models():
    """transformers masks attention between packed sequences (position_ids that restart in a row) when no cache is
    used; cp runs one causal attention over the row: refused before the cut, alike on every rank."""
    tf = pytest.importorskip("transformers")
    llama = _hf_small(tf, tf.LlamaForCausalLM, tf.LlamaConfig)
    state = ContextParallel(CPGroup(2, 1, None))
    state.attach(llama, hook=False)
    x = torch.randint(0, 32, (2, 8))
    packed = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]).expand(2, -1)
    with pytest.raises(ValueError, match=r"`position_ids` that restart or jump inside a row.*or use cp=1"):
        state.split_sequences(x, {"position_ids": packed})
    shifted = torch.arange(3, 11).expand(2, -1)  # one sequence per row, starting anywhere: cut as given
    cut = state.split_sequences(x, {"position_ids": shifted})
    assert torch.equal(cut["position_ids"], shifted[:, state.cp.positions(8, "cpu")])
    state.detach()
    gpt = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8)  # no per-sequence mask: positions as given
    state.attach(gpt, hook=False)
    assert torch.equal(state.split_sequences(x, {"position_ids": packed})["position_ids"], packed[:, 2:6])
    state.detach()


def test_network_lookup():
    class Task(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)

    task = Task()
    assert find_network(task) is task.model
    with pytest.raises(ValueError, match="cp_network='nope'"):
        find_network(task, "nope")

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ValueError, match="pass cp_network="):
        find_network(Two())


def test_gpt_positions_are_those_given():
    torch.manual_seed(0)
    net = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8)
    x = torch.randn(2, 4, 8)
    pos = torch.tensor([[0, 1, 12, 13]] * 2)
    assert torch.equal(net.pos_emb(x, pos), x + net.pos_emb.weight[pos])
    assert torch.equal(net.pos_emb(x), x + net.pos_emb.weight[:4])
    idx = torch.randint(0, 32, (2, 6))
    assert torch.equal(net(idx), net(idx, position_ids=torch.arange(6).expand(2, -1)))


def test_pipeline_cp_refusals_and_zero1():
    spec = MeshSpec(world_size=4, devices_per_node=4, pp=2, cp=2).resolve()
    with pytest.raises(ValueError, match="broadcast_output=True with cp=2: each rank's output holds its part"):
        PipelineStrategy(pp=2, cp=2, broadcast_output=True).validate_config(spec)
    with pytest.raises(ValueError, match="`cp_network='net'` differs from `network='model'`"):
        PipelineStrategy(pp=2, cp=2, cp_network="net")
    spec = MeshSpec(world_size=4, devices_per_node=4, cp=2).resolve()
    with pytest.raises(ValueError, match="zero_stage=1 .* cp=2 .* zero_stage=2 or 3"):
        HybridShardStrategy(cp=2, zero_stage=1).validate_config(spec)


def test_pipeline_stages_take_positions():
    from lightning_dist.parallelize.cp import cp_model_problems
    from lightning_dist.parallelize.pipeline.pruned import MODEL_INPUT

    torch.manual_seed(0)
    net = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8).double()
    assert not cp_model_problems(net, cp=2)  # GPT.forward takes position_ids
    (msg,) = cp_model_problems(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8)), cp=2)
    assert "takes no `position_ids`" in msg and "cp=1" in msg
    # a stage runs GPT.forward itself: the positions reach pos_emb as on one device, on either side of the cut
    layout = network_layout(net)
    first, last = (layout.build_stage(net, [i], first=i == 0, last=i == 1) for i in (0, 1))
    idx, pos = torch.randint(0, 32, (2, 4)), torch.tensor([[0, 1, 6, 7]] * 2)
    with torch.no_grad():
        hidden = first.run_local(idx, position_ids=pos, **{MODEL_INPUT: idx})
        out = last.run_local(hidden, position_ids=pos, **{MODEL_INPUT: idx})
        assert torch.equal(out, net(idx, position_ids=pos))
        assert not torch.equal(out, net(idx))  # the positions mattered


def test_pipeline_cut_and_hf_loss_shares_add_up_to_the_whole_sequences_loss():
    torch.manual_seed(0)
    B, S, V, cp = 2, 8, 5, 2
    x, labels, logits = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S)), torch.randn(B, S, V).double()
    labels[0, 3] = -100
    whole = hf_labels_loss(logits, labels)
    total = 0.0
    for rank in range(cp):
        state = ContextParallel(CPGroup(cp, rank, None))  # the cut needs no group (the exchange does)
        cut_x, extra, cut_labels, count = cut_for_cp(state, x, {"attention_mask": torch.ones(B, S)}, labels)
        positions = state.cp.positions(S, x.device)
        assert torch.equal(cut_x, x[:, positions]) and set(extra) == {"position_ids"}  # the all-ones mask dropped
        assert torch.equal(extra["position_ids"], positions.expand(B, -1))
        assert count == (labels[:, 1:] != -100).sum()
        # the micro-batches (dim 0) of this rank: each its share; the runner divides each by m
        m = B
        for i in range(m):
            share = hf_labels_loss(logits[i : i + 1, positions], cut_labels[i : i + 1], **cp_share(state, count, m))
            total += share / m / cp  # FSDP2 averages the gradients (and the loss group the loss) over cp
        with pytest.raises(ValueError, match=r"target .* must be \[batch, seq, ...\] .* length 8; got \(2,\)"):
            cut_target(state, labels[:, 0], "Task")
        assert torch.equal(cut_target(state, labels, "Task"), labels[:, positions])
    assert torch.allclose(total, whole, rtol=1e-14, atol=0)  # the cp ranks' mean is the whole sequences' loss


def test_ring_kernel_is_the_devices_and_refuses_what_none_serves():
    from lightning_dist._integrations.torch_ring_attention import ring_kernel

    aten = torch.ops.aten
    for dtype in (torch.float64, torch.float32, torch.bfloat16):  # CPU's flash kernel takes every floating dtype
        assert ring_kernel("cpu", dtype).forward is aten._scaled_dot_product_flash_attention_for_cpu.default
    # CUDA: torch's own ring wrappers' kernels, flash for half precision and memory-efficient for float32
    assert ring_kernel("cuda", torch.bfloat16).backward is aten._scaled_dot_product_flash_attention_backward.default
    assert ring_kernel("cuda", torch.float16).forward is aten._scaled_dot_product_flash_attention.default
    efficient = ring_kernel("cuda", torch.float32)
    assert efficient.forward is aten._scaled_dot_product_efficient_attention.default
    assert efficient.grad_out_name == "grad_out_" and efficient.forward_kwargs(None)["compute_log_sumexp"] is True
    seed, offset = torch.tensor(1), torch.tensor(2)
    assert efficient.backward_kwargs(0.5, (seed, offset))["philox_seed"] is seed
    flash = ring_kernel("cuda", torch.bfloat16).backward_kwargs(None, (None, None, 8, 8, seed, offset, None))
    assert flash["max_q"] == 8 and flash["philox_offset"] is offset and flash["dropout_p"] == 0.0
    with pytest.raises(RuntimeError, match=r"torch.float64.*cp_style='ulysses'"):
        ring_kernel("cuda", torch.float64)
    with pytest.raises(RuntimeError, match=r"'xla'.*cp_style='ulysses'"):
        ring_kernel("xla", torch.float32)


def test_ring_refuses_a_mask_and_dropout_before_any_collective():
    from lightning_dist.parallelize.cp import ring_sdpa

    cp = CPGroup(2, 0, group=None, style="ring")  # no group: a refusal must come before the ring's first collective
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="explicit `attn_mask`"):
        ring_sdpa(cp, q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"dropout_p=0.1.*cp_style='ulysses'"):
        ring_sdpa(cp, q, q, q, dropout_p=0.1, is_causal=True)
    with pytest.raises(RuntimeError, match="query heads a multiple of the key/value heads"):
        ring_sdpa(cp, torch.randn(1, 3, 4, 8), q, q, is_causal=True)


def test_the_ring_needs_no_heads_divisible_by_cp():
    net = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=3, n_embd=24)
    assert any("do not divide over cp=2" in p for p in cp_model_problems(net, cp=2))
    assert cp_model_problems(net, cp=2, style="ring") == []


def test_a_loss_on_the_whole_target_is_refused_naming_the_convention():
    import torch.nn.functional as F

    from lightning_dist.parallelize.cp import ContextParallelAttention, loss_split_problem

    cp = CPGroup(2, 0, None)
    logits, target = torch.randn(32, 64), torch.randint(0, 64, (64,))  # this rank's 32 of the 64 tokens, whole target
    # torch alone: "Expected input batch_size (32) to match target batch_size (64)"
    with ContextParallelAttention(cp), pytest.raises(ValueError) as err:
        F.cross_entropy(logits, target)
    msg = str(err.value)
    assert "shape (32, 64) and a target of shape (64,)" in msg and "(cp=2)" in msg
    assert "self.pipeline_loss(logits, target)" in msg and "labels=" in msg
    # class dim 1 ([B, V, S/cp] vs [B, S]), elementwise losses, keyword arguments
    assert loss_split_problem(F.cross_entropy, (torch.randn(2, 9, 4), torch.zeros(2, 8)), {}, 2)
    assert loss_split_problem(F.mse_loss, (), {"input": torch.randn(2, 4), "target": torch.randn(2, 8)}, 2)
    # what the strategy serves (the target's chunks) and any mismatch that is not cp's pass through to torch
    with ContextParallelAttention(cp):
        assert F.cross_entropy(logits, target[:32]).dim() == 0
        with pytest.raises((RuntimeError, ValueError), match="batch_size"):
            F.cross_entropy(logits, target[:40])
    assert loss_split_problem(F.nll_loss, (torch.randn(4, 3), torch.zeros(12, dtype=torch.long)), {}, 2) is None


def test_unsplit_passes_the_inputs_through_the_hook_and_holds_no_mode():
    net = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8)
    state = ContextParallel(CPGroup(2, 1, None))
    state.attach(net)
    idx = torch.randint(0, 32, (2, 8))
    assert net(idx).shape[1] == 4  # this rank's chunks
    with state.unsplit():
        assert torch.equal(net(idx), GPT.forward(net, idx))  # whole sequences, positions 0..7
        with state.active():
            assert torch._C._len_torch_function_stack() == 0  # no exchange in the reference pass
    assert state._off is False and net(idx).shape[1] == 4
    state.detach()


def test_probe_batches_fit_the_network_and_the_split():
    from lightning_dist.parallelize.cp_probe import probe_inputs

    net = GPT(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=8)
    x, what = probe_inputs(net, 2)
    assert x.shape == (2, 8) and x.dtype == torch.long and int(x.max()) < 50
    two = nn.ModuleDict({"tok": nn.Embedding(50, 4), "pos": nn.Embedding(16, 4)})
    assert int(probe_inputs(two, 2)[0].max()) < 16  # below the smallest embedding: valid ids for any of them
    assert what == "2 x 8 made-up tokens" and torch.equal(x, probe_inputs(net, 2)[0])  # the same on every rank
    assert probe_inputs(net, 4)[0].shape == (2, 16) and probe_inputs(net, 8)[0].shape == (2, 16)  # 4 cp, else 2 cp
    assert probe_inputs(net, 16) is None  # 2 x cp = 32 positions > block_size 16: cp cannot split it either
    example = torch.arange(60).view(3, 20)  # cut to the longest multiple of 2 cp within 4 cp, rows repeated
    got, what = probe_inputs(net, 2, example=example, rows=4)
    assert torch.equal(got, torch.cat([example[:, :8], example[:1, :8]])) and "example_input_array" in what
    assert probe_inputs(nn.Sequential(nn.Linear(3, 4)), 2)[0].shape == (2, 8, 3)


def test_probe_loss_of_the_chunks_adds_up_to_the_whole_and_notes_pooling():
    from lightning_dist.parallelize.cp_probe import ProbeLoss

    out = torch.randn(2, 8, 5, dtype=torch.float64)
    index = torch.arange(16).view(2, 8)
    whole = ProbeLoss(16)(out, index)
    # each rank's chunks meet the same weights as in the whole pass: the ranks' losses sum to the whole's
    parts = [
        ProbeLoss(16)(out[:, pos], index[:, pos]) for pos in (CPGroup(2, r, None).positions(8, "cpu") for r in (0, 1))
    ]
    assert torch.allclose(sum(parts), whole, rtol=1e-14, atol=0)
    assert ProbeLoss(16, scale=2.0)(out, index) == 2 * whole
    pooled = ProbeLoss(16)
    pooled(out.mean(1), index)
    assert pooled.pooled and not ProbeLoss(16).pooled


def test_self_check_option_is_checked_and_documented():
    with pytest.raises(ValueError, match="`self_check='no'` must be True or False"):
        HybridShardStrategy(cp=2, self_check="no")
    assert HybridShardStrategy(cp=2, self_check=False).self_check is False
    assert PipelineStrategy(pp=2, cp=2, self_check=False).self_check is False
    assert "self_check" in MeshStrategy.__doc__  # its Args


def test_the_unsplit_pass_runs_the_whole_sequences_and_a_network_it_cannot_call_is_refused():
    import contextlib

    from lightning_dist.parallelize.cp_probe import NetworkProbe, ProbeLoss, probe_inputs

    torch.manual_seed(0)
    net = GPT(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8).double()
    state = ContextParallel(CPGroup(2, 0, None))
    state.attach(net)
    x, _ = probe_inputs(net, 2)
    probe = NetworkProbe(state, net, "model", x, forward_context=contextlib.nullcontext)
    index = torch.arange(16).view(2, 8)
    out = probe.run(split=False, loss=ProbeLoss(16), index=index)
    assert torch.equal(out, GPT.forward(net, x).detach()) and net.lm_head.weight.grad is not None
    assert net.training and not out.requires_grad  # eval inside the pass only; the output detached

    class NeedsTargets(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 4)

        def forward(self, idx, targets, position_ids=None):
            return self.emb(idx)

    other = NeedsTargets()
    state.detach()
    state.attach(other)
    with pytest.raises(
        ValueError, match=r"could not call NeedsTargets on its probe batch \(2, 8\).*example_input_array"
    ):
        NetworkProbe(state, other, "model", x, forward_context=contextlib.nullcontext).run(
            split=False, loss=None, index=index
        )
    state.detach()
