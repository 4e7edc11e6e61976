"""The planner predicts what the runtime does: it calls the runtime's own pipeline split, block-list finder,
schedule table and bubble formula (issue: one source of truth), checked here model by model."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import planner
from lightning_dist.models import GPT, ShapesCNN, ViT
from lightning_dist.parallelize.counts import count_params, largest_block_list
from lightning_dist.parallelize.pipeline.split import network_layout, plan_split
from lightning_dist.rules import SCHEDULES, bubble_theory


def _hf_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4))


def _litgpt() -> torch.nn.Module:
    litgpt = pytest.importorskip("litgpt", reason="litgpt is not installed (make install adds it --no-deps)")
    # lm_head registered before `transformer`, the blocks in the ModuleDict's `h`: split as the model, pruned
    return litgpt.GPT(litgpt.Config(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=64, padded_vocab_size=64))


EXAMPLES = {
    "gpt": lambda: GPT(n_layer=6),
    "gpt_uneven": lambda: GPT(n_layer=5),
    "gpt_tied": lambda: GPT(n_layer=4, tie_weights=True),
    "vit": lambda: ViT(depth=4),
    "cnn": lambda: ShapesCNN(n_blocks=4),
    "hf_llama": _hf_llama,
    "hf_gpt2": _hf_gpt2,
    "litgpt": _litgpt,
}


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_planner_split_equals_the_strategy_split(name, pp):
    model = EXAMPLES[name]()
    runtime = plan_split(model, pp, split="params")  # what PipelineStrategy(split="params") builds
    counts = count_params(model)
    assert counts.stage_params(pp) == [s.params for s in runtime.stages], runtime
    # the same block list: the planner's finder is the one FSDP units and pipeline splits use
    layout = network_layout(model)
    found = largest_block_list(model)
    assert found is not None and found[1] is model.get_submodule(layout.block_list or ""), (found, layout)


def test_planner_schedules_and_bubble_are_the_runtimes():
    assert planner.SCHEDULES == tuple(SCHEDULES)  # same names, same spelling
    for m in (4, 8, 32):
        assert planner.pipeline_idle_fraction(stages=4, micro_batches=m) == bubble_theory(4, m)
        assert planner.pipeline_idle_fraction(
            stages=4, micro_batches=m, schedule="interleaved_1f1b", virtual_stages=2
        ) == bubble_theory(4, m, stages_per_rank=2)
