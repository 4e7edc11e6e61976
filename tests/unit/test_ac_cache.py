"""Checkpointed blocks that are handed a KV cache: recomputed without it, in a real step and in the dry run."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallelize.ac import apply_ac

tf = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402


def _llama(layers: int = 2) -> nn.Module:
    cfg = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    assert cfg.use_cache  # the default: the model hands each layer a cache it appends its keys and values to
    return tf.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("padded", [False, True])
def test_an_unmodified_hf_llama_checkpointed_has_the_gradients_of_no_ac(mode, padded):
    # each decoder layer appends to the model's KV cache: recomputed with it, a layer runs on twice the keys (torch's
    # selective checkpoint refuses the extra ops; full AC fails on the padding mask's shape)
    torch.manual_seed(0)
    ref = _llama().double()
    model = copy.deepcopy(ref)
    apply_ac(model, mode=mode)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    if padded:
        mask[1, -3:] = 0
    for m in (ref, model):
        m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_a_block_keeps_its_cache_without_gradients_and_when_it_only_reads_it():
    from lightning_dist._integrations import transformers_cache

    class Block(nn.Module):
        def forward(self, x, cache=None, use_cache=False):
            if cache is not None:
                cache.append(x)
            return x * 2

    block = Block()
    apply_ac(block, units=[block], mode="full")
    cache: list = []
    x = torch.ones(2, requires_grad=True)
    block(x, cache=cache, use_cache=True).sum().backward()
    assert cache == []  # with gradients: called without the cache, in forward and in the recompute
    with torch.no_grad():
        block(x, cache=cache, use_cache=True)
    assert len(cache) == 1  # no backward, no recompute: the cache is written as asked

    class Reader(LlamaDecoderLayer):
        _can_checkpoint_with_cache = True

    Reader.__module__ = "transformers.models.reader"  # a transformers layer that declares it only reads its cache
    cfg = tf.LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_hidden_layers=1)
    assert transformers_cache.reads_cache_only(Reader(cfg, 0))
    assert not transformers_cache.reads_cache_only(LlamaDecoderLayer(cfg, 0))
    assert not transformers_cache.reads_cache_only(block)


def test_an_untested_transformers_release_is_refused_for_the_cache_flag(monkeypatch):
    from lightning_dist._integrations import transformers_cache

    monkeypatch.setattr(transformers_cache, "TRANSFORMERS_CACHE_TESTED", ("0.1.0", "0.2.0"))
    cfg = tf.LlamaConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_hidden_layers=1)
    with pytest.raises(RuntimeError, match=r"KV-cache rule .*transformers>=0\.1\.0,<0\.2\.0"):
        transformers_cache.reads_cache_only(LlamaDecoderLayer(cfg, 0))


class LlamaTask(pl.LightningModule):
    """An unmodified HF Llama in a LightningModule (its loss from `labels`), with the dry run's batch hook."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _llama()

    def dry_run_batch(self, n: int, seq_len: int | None) -> torch.Tensor:
        return torch.randint(0, 128, (n, seq_len or 16))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_hf_llama_dry_runs_with_selective_ac_in_one_process(fake_world, precision):
    # rank 1 of a 2-rank fake world in this process (torch's fake process group: no peers, fake tensors)
    from lightning_dist.dryrun import DryRunConfig, simulate_rank

    def run(ac):
        config = DryRunConfig(
            model=f"{__name__}.LlamaTask",
            strategy="hsdp",
            strategy_args={"activation_checkpointing": ac},
            world_size=2,
            devices_per_node=2,
            precision=precision,
            batch_size=4,
        )
        return simulate_rank(config, 1)

    selective, full = run("selective"), run("full")
    assert not dist.is_initialized()
    assert selective["states"]["total"] == full["states"]["total"] > 0
    # selective keeps the matmul outputs full AC recomputes
    assert 0 < full["peak_activation_bytes"] < selective["peak_activation_bytes"], (full, selective)
