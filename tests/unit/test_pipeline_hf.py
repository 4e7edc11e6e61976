"""Pipeline stages of unmodified HuggingFace causal LMs (one process): layout, stages, checks, refusals, loss."""

from __future__ import annotations

import pytest
import torch
from _harness import tiny_qwen3_moe
from torch import nn

from lightning_dist.mesh import MeshSpec
from lightning_dist.parallelize.pipeline.checks import staged_forward_problem, tied_stages
from lightning_dist.parallelize.pipeline.hf import hf_example_inputs, hf_labels_loss, labelled_tokens
from lightning_dist.parallelize.pipeline.split import build_stage_module, network_layout, plan_split, profile_costs
from lightning_dist.strategies.pipeline.strategy import PipelineStrategy

tf = pytest.importorskip("transformers")
V = 32


def _llama(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return tf.LlamaForCausalLM(cfg).double()


def _gpt2(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=V,
        n_embd=16,
        n_layer=layers,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return tf.GPT2LMHeadModel(cfg).double()


def _gemma3_multimodal(layers: int = 4) -> nn.Module:  # what AutoModelForCausalLM gives for a Gemma 3 4B+ checkpoint
    torch.manual_seed(0)
    text = dict(_COMMON, num_hidden_layers=layers, num_key_value_heads=2, head_dim=4, sliding_window=8)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16)
    cfg = tf.Gemma3Config(text_config=text, vision_config=dict(vision, patch_size=4), mm_tokens_per_image=4)
    return tf.AutoModelForCausalLM.from_config(cfg).double()


def test_a_multimodal_model_stages_its_text_model():
    # Gemma3ForConditionalGeneration: the blocks are in `model.language_model` (a text model with a pp plan of its
    # own), beside a vision tower; before 2026-12-06 refused ("its base model has no block list")
    lay = network_layout(_gemma3_multimodal())
    assert (lay.stem, lay.block_list, lay.head) == (
        ("model.vision_tower", "model.multi_modal_projector", "model.language_model.embed_tokens"),
        "model.language_model.layers",
        ("model.language_model.norm", "lm_head"),
    )


def test_layout_from_the_pp_plan_and_the_block_list_name():
    lay = network_layout(_llama())
    assert (lay.stem, lay.block_list, lay.blocks, lay.head) == (
        ("model.embed_tokens",),
        "model.layers",
        ("0", "1", "2", "3"),
        ("model.norm", "lm_head"),
    )
    lay = network_layout(_gpt2())  # no base_model_pp_plan: the conventional block-list name `h`
    assert (lay.stem, lay.block_list, lay.head) == (
        ("transformer.wte", "transformer.wpe", "transformer.drop"),
        "transformer.h",
        ("transformer.ln_f", "lm_head"),
    )


def _granite(layers: int = 4) -> nn.Module:  # the embeddings scaled in the model's forward, the logits scaled
    torch.manual_seed(0)
    cfg = tf.GraniteConfig(**_COMMON, num_hidden_layers=layers, embedding_multiplier=2.0, logits_scaling=4.0)
    return tf.GraniteForCausalLM(cfg).double()


def _olmo(layers: int = 4) -> nn.Module:  # a final norm without parameters after the blocks
    torch.manual_seed(0)
    return tf.OlmoForCausalLM(
        tf.OlmoConfig(**_COMMON, num_hidden_layers=layers, pad_token_id=0, eos_token_id=0)
    ).double()


def _gemma2(layers: int = 4) -> nn.Module:  # the embeddings scaled by sqrt(hidden) in the model's forward
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(**_COMMON, num_hidden_layers=layers, head_dim=4, final_logit_softcapping=30.0)
    return tf.Gemma2ForCausalLM(cfg).double()


def _bloom(layers: int = 4) -> nn.Module:  # ALiBi from the attention mask; blocks return tuples
    torch.manual_seed(0)
    cfg = tf.BloomConfig(vocab_size=V, hidden_size=16, n_layer=layers, n_head=4, pad_token_id=0, eos_token_id=0)
    return tf.BloomForCausalLM(cfg).double()


def _falcon_h1(layers: int = 4) -> nn.Module:  # attention beside a state-space mixer; blocks return tuples
    torch.manual_seed(0)
    cfg = tf.FalconH1Config(
        **_COMMON, num_hidden_layers=layers, num_key_value_heads=2, head_dim=4, pad_token_id=0, eos_token_id=0
    )
    return tf.FalconH1ForCausalLM(cfg).double()


def _ctrl(layers: int = 4) -> nn.Module:  # the input embeddings scaled in place (`*=`) in the model's forward
    torch.manual_seed(0)
    cfg = tf.CTRLConfig(
        vocab_size=V, n_embd=16, dff=32, n_layer=layers, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0
    )
    return tf.CTRLLMHeadModel(cfg).double()


_COMMON = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=4, max_position_embeddings=16)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _openai_gpt(layers: int = 4) -> nn.Module:  # blocks return lists
    torch.manual_seed(0)
    drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = tf.OpenAIGPTConfig(vocab_size=V, n_embd=16, n_layer=layers, n_head=4, n_positions=16, **drop)
    return tf.OpenAIGPTLMHeadModel(cfg).double()


def _modernbert_decoder(layers: int = 4) -> nn.Module:  # the embeddings called with keywords only
    torch.manual_seed(0)
    cfg = tf.ModernBertDecoderConfig(**_COMMON, num_hidden_layers=layers, **_IDS, sep_token_id=3, cls_token_id=3)
    return tf.ModernBertDecoderForCausalLM(cfg).double()


def _llama4(layers: int = 4) -> nn.Module:  # base_model_prefix `language_model` names no child (`model` holds it)
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(
        **_COMMON,
        intermediate_size_mlp=32,
        num_hidden_layers=layers,
        num_key_value_heads=2,
        head_dim=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        **_IDS,
    )
    return tf.Llama4ForCausalLM(cfg).double()


@pytest.mark.parametrize("make", [_bloom, _falcon_h1, _openai_gpt, _modernbert_decoder, _llama4])
def test_models_of_other_forms_stage_with_any_number_of_blocks_skipped(make):
    """Forms once refused: blocks returning tuples or lists, where the forward takes `block(...)[0]` (a block another
    stage owns now returns a block output's structure: before, those after a stage's last block indexed the hidden
    states down to a scalar); a stem part called with keywords only; a base-model prefix naming no child. One stage
    per block of 6, outputs and gradients against the whole model."""
    net = make(6)
    assert staged_forward_problem(net, hf_example_inputs(net)) is None


@pytest.mark.parametrize(
    "make", [_llama, _gpt2, _granite, _olmo, _gemma2, _bloom, _falcon_h1, _ctrl, _openai_gpt, _gemma3_multimodal]
)
def test_stages_chain_to_the_whole_model_under_single_device_names(make):
    net = make()
    split = plan_split(net, 3, split=[1, 3])
    sample = hf_example_inputs(net)
    sample["attention_mask"][0, -3:] = 0  # padding reaches every stage's attention
    assert staged_forward_problem(net, sample) is None
    stages = [build_stage_module(net, split, [s]) for s in range(3)]
    with torch.no_grad():
        x = sample["input_ids"]
        for st in stages:
            x = st.run_local(x, attention_mask=sample["attention_mask"])
        expected = net(**sample).logits
    assert (x - expected).abs().max().item() < 1e-12
    names = [{n for n, _ in st.named_parameters()} for st in stages]
    whole = {n for n, _ in net.named_parameters(remove_duplicate=False)}
    assert set().union(*names) == whole and sum(map(len, names)) == len(whole)  # disjoint, original names
    blocks = split.layout.block_list
    assert any(f"{blocks}.3." in n for n in names[2]) and not any(f"{blocks}.0." in n for n in names[2])
    # the original model is untouched: stages have their own module objects above the shared blocks
    assert len(net.get_submodule(split.layout.block_list)) == 4


def test_tied_head_is_held_by_the_first_and_last_stage():
    net = _gpt2()
    split = plan_split(net, 2)
    assert tied_stages(net, split) == [(("transformer.wte.weight", "lm_head.weight"), (0, 1))]
    first, last = (build_stage_module(net, split, [s]) for s in (0, 1))
    assert first.transformer.wte.weight is last.lm_head.weight  # one parameter; the strategy sums its gradients


def test_balanced_split_measures_the_blocks_inside_the_models_forward():
    net = _llama()
    stem, blocks, head = profile_costs(net, network_layout(net), hf_example_inputs(net), repeats=2)
    assert len(blocks) == 4 and all(b > 0 for b in blocks) and stem > 0 and head > 0
    split = plan_split(net, 2, split="balanced", costs=(stem, blocks, head))
    assert [len(s.blocks) for s in split.stages] in ([2, 2], [1, 3], [3, 1])


def test_labels_loss_adds_up_over_micro_batches_with_different_token_counts():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 6, V, dtype=torch.float64), torch.randint(0, V, (4, 6))
    labels[1, 2:] = -100
    labels[3, 4:] = -100
    whole = hf_labels_loss(logits, labels)
    n = labelled_tokens(labels)
    parts = sum(hf_labels_loss(lo, la, num_items=n) for lo, la in zip(logits.split(1), labels.split(1)))
    assert torch.allclose(whole, parts, rtol=1e-15, atol=0) and whole.dtype == torch.float64
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert torch.allclose(whole, ref, rtol=1e-15, atol=0)


def _validate(net):
    import lightning.pytorch as pl

    class Task(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = net

    strategy = PipelineStrategy(pp=2, split="params")
    strategy.connect(Task())
    strategy.validate_config(MeshSpec(world_size=2, devices_per_node=2, pp=2).resolve())
    return strategy


def test_hf_model_without_pipeline_loss_is_accepted_and_checked_up_front():
    _validate(_llama())  # the labels convention stands in for pipeline_loss; the stages are checked on config ids


def test_a_model_whose_forward_does_not_tolerate_missing_parts_is_refused_with_the_approach_tried():
    class EmbedNorm(tf.LlamaForCausalLM):  # its forward reads the embedding on every stage
        def forward(self, input_ids=None, inputs_embeds=None, **kw):
            out = super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kw)
            out.logits = out.logits + self.model.embed_tokens.weight.mean()
            return out

    torch.manual_seed(0)
    net = EmbedNorm(_llama().config).double()
    with pytest.raises(
        ValueError,
        match=r"Cannot split EmbedNorm into pipeline stages: its forward fails on a stage"
        r".*Tried: a stage = the model with the blocks of model.layers",
    ):
        _validate(net)


def test_a_network_of_no_known_shape_is_refused_naming_what_was_tried():
    class TwoLists(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.dec = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(TypeError) as err:
        network_layout(TwoLists())
    text = str(err.value)  # every route, each with its reason
    assert text.startswith("Cannot split TwoLists into pipeline stages; routes tried:")
    for reason in (
        "a HuggingFace causal LM (config.base_model_pp_plan): it is not one",
        "an nn.Sequential (its children are the blocks): it is not one",
        "the child holding them: it has 2 block lists ('enc', 'dec')",
    ):
        assert reason in text, (reason, text)


@pytest.mark.parametrize("make", [_llama, _gpt2])
def test_joined_stages_are_the_whole_model_again(make):
    import copy

    from lightning_dist.parallelize.pipeline.split import join_stages

    net = make()
    split = plan_split(net, 4, split=[1, 2, 3])
    # what GradientParityCheck gathers: plain copies of every rank's stage module, one per pp rank
    pieces = [copy.deepcopy(build_stage_module(net, split, [s])) for s in range(4)]
    whole = join_stages(split, pieces)
    assert type(whole) is type(net)
    assert [n for n, _ in whole.named_parameters(remove_duplicate=False)] == [
        n for n, _ in net.named_parameters(remove_duplicate=False)
    ]
    sample = hf_example_inputs(net)
    with torch.no_grad():
        assert torch.equal(whole(**sample).logits, net(**sample).logits)


def test_an_hf_moe_router_loss_pipelines_and_one_whose_routers_cannot_be_found_is_refused(monkeypatch):
    net = tiny_qwen3_moe(tf, output_router_logits=True, router_aux_loss_coef=0.05)
    _validate(net)  # its routers report through hooks (the parity: tests/distributed/test_moe.py)
    # a modeling module that records no router logits: the stages could not count the routing
    base = next(c for c in type(net).__mro__ if "_can_record_outputs" in vars(c))
    recorded = {k: v for k, v in base._can_record_outputs.items() if k != "router_logits"}
    monkeypatch.setattr(base, "_can_record_outputs", recorded)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM adds a router load-balancing loss") as err:
        _validate(tiny_qwen3_moe(tf, output_router_logits=True, router_aux_loss_coef=0.05))
    assert "cannot find its router modules" in str(err.value) and "output_router_logits=False" in str(err.value)


def test_gemma4_stages_and_its_per_layer_inputs_are_refused_naming_pp1():
    """Gemma 4 stages at float64 parity; with per-layer input embeddings (its small variants: parts registered after
    the block list but run before it, whose output every block takes) it is refused, with a fix that does not ask
    to edit transformers' class."""
    if not hasattr(tf, "Gemma4TextConfig"):
        pytest.skip("this transformers release has no Gemma 4")

    def gemma4(per_layer: int) -> nn.Module:
        torch.manual_seed(0)
        cfg = tf.Gemma4TextConfig(
            **_COMMON,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=4,
            global_head_dim=4,
            sliding_window=8,
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=V,
            **_IDS,
        )
        return tf.Gemma4ForCausalLM(cfg).double()

    net = gemma4(0)
    assert staged_forward_problem(net, hf_example_inputs(net)) is None
    net = gemma4(4)
    problem = staged_forward_problem(net, hf_example_inputs(net))
    assert "its forward runs them as embed_tokens -> embed_tokens_per_layer" in problem, problem
    assert "train this model with pp=1" in problem and "__init__" not in problem


def test_a_residual_stream_of_another_shape_than_the_embedding_stages():
    """Models whose blocks carry several residual streams ([B, T, streams, C], from the embedding [B, T, C]: DeepSeek
    V4's hyper-connections) and read an absent part's parameter dtype in their forward: a later stage's forward gets
    zeros shaped as the embedding gives them, and the part's parameters as meta tensors. Before, the stand-in was the
    received activation ([B, T, streams, C]), which the forward's expand refused, and the dtype read failed."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.ff = nn.Linear(2, 2, bias=False), nn.Linear(8, 8)

        def forward(self, x):  # [B, T, 2, C]: the streams mixed, then each through the feed-forward
            return x + self.ff(torch.tanh(self.mix(x.transpose(2, 3)).transpose(2, 3)))

    class Streams(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.ln_f, self.lm_head = nn.LayerNorm(8), nn.Linear(8, V)

        def forward(self, idx):
            x = self.wte(idx).unsqueeze(2).expand(-1, -1, 2, -1).contiguous()
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x.mean(2).to(self.ln_f.weight.dtype)))

    torch.manual_seed(0)
    net = Streams().double()
    assert staged_forward_problem(net, torch.randint(0, V, (2, 8))) is None
    if not hasattr(tf, "DeepseekV4Config"):
        return
    small = dict(q_lora_rank=16, o_lora_rank=16, o_groups=2, index_n_heads=4, index_head_dim=8, index_topk=8)
    cfg = tf.DeepseekV4Config(
        **_COMMON,
        **small,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=8,
        qk_rope_head_dim=4,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        mlp_layer_types=["moe"] * 4,  # its hash-routed layers read the token ids in every block: refused
        layer_types=tf.DeepseekV4Config().layer_types[:4],
        **_IDS,
    )
    torch.manual_seed(0)
    net = tf.DeepseekV4ForCausalLM._from_config(cfg, experts_implementation="eager").double()
    assert staged_forward_problem(net, hf_example_inputs(net)) is None
