"""The router load-balancing loss split over micro-batches (``StagedRouterLoss``), in one process: a counting pass,
then each micro-batch's share joined to its backward, gives the whole batch's gradient; for the pack's ``MoEGPT``
(one loss per layer) and an unmodified transformers Qwen3-MoE (one loss over the layers, through its routers' hooks,
a padding mask included). The pipelines themselves: tests/distributed/test_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dist.models.moe import MoEGPT
from lightning_dist.parallelize.moe import StagedRouterLoss
from tests._harness import tiny_qwen3_moe

M = 4  # micro-batches
ROUTER = [True]  # the dry-run task's output_router_logits


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def _close(a, b):
    """Equal to float64 round-off, relative to the largest gradient (a key bias's is zero in exact arithmetic)."""
    scale = max(g.abs().max() for g in b)
    assert max((ga - gb).abs().max() for ga, gb in zip(a, b)) <= 1e-12 * scale


def test_the_pack_moe_gpt_router_loss_split_over_micro_batches_gives_the_whole_batch_gradient():
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=4, top_k=2, expert_hidden=8)
    model = model.double()
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))

    def ce(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    whole = _grads(model, ce(model(x), y) + 0.05 * model.aux_loss())
    aux_whole = model.aux_loss().detach()
    staged = StagedRouterLoss()
    with staged.counting(M), torch.no_grad():
        for i in [0, *range(M)]:  # the first: a new schedule's metadata-inference call, left out
            model(x.tensor_split(M)[i])
    aux = staged.reduce(None, None, "cpu")
    with staged.attaching(torch.tensor(0.05, dtype=torch.float64)):
        total = sum(ce(model(xs), ys) / M for xs, ys in zip(x.tensor_split(M), y.tensor_split(M)))
    assert torch.allclose(aux, aux_whole.double(), rtol=1e-12)
    _close(_grads(model, total), whole)
    # without the counted totals (each micro-batch's own loss): a different gradient, so the check above can fail
    chunks = zip(x.tensor_split(M), y.tensor_split(M))
    local = sum(ce(model(xs), ys) / M + 0.05 * model.aux_loss() / M for xs, ys in chunks)
    assert max((a - b).abs().max() for a, b in zip(_grads(model, local), whole)) > 1e-6


def test_a_transformers_moe_router_loss_through_its_routers_hooks_gives_the_whole_batch_gradient():
    transformers = pytest.importorskip("transformers")
    from lightning_dist._integrations.transformers_routers import (
        StageRouterHooks,
        original_loss_function,
        router_loss_spec,
    )
    from lightning_dist.parallelize.pipeline.hf import pipeline_loss_function

    torch.manual_seed(0)
    model = tiny_qwen3_moe(
        transformers, output_router_logits=True, router_aux_loss_coef=0.05, experts_implementation="eager"
    ).double()
    model.loss_function = pipeline_loss_function
    assert router_loss_spec(tiny_qwen3_moe(transformers)) is None  # no router loss: nothing to count
    spec = router_loss_spec(model)
    assert (spec.num_experts, spec.top_k, spec.coef, spec.count) == (4, 2, 0.05, 2)
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # padding: its rows count neither as tokens nor as choices
    whole = model(x, labels=y, attention_mask=mask).loss
    hooks = StageRouterHooks(model, spec, original_loss_function(model))
    staged = StagedRouterLoss(joint_experts=spec.num_experts)
    chunks = list(zip(x.tensor_split(M), y.tensor_split(M), mask.tensor_split(M)))
    with staged.counting(M), torch.no_grad():
        for xs, _, ms in [chunks[0], *chunks]:
            model(xs, attention_mask=ms)
    staged.reduce(None, None, "cpu")
    hooks.hold()  # the statistics are the model's own function's on the last call
    n = (y[:, 1:] != -100).sum()
    with staged.attaching(torch.tensor(spec.coef, dtype=torch.float64)):
        total = 0
        for xs, ys, ms in chunks:  # each micro-batch's summed cross-entropy over the whole batch's targets
            logits = model(xs, attention_mask=ms).logits
            total = total + pipeline_loss_function(logits, ys, num_items_in_batch=n)
    hooks.remove()
    _close(_grads(model, total), _grads(model, whole))


QwenMoETask = None  # made by `_qwen_task` (transformers imported only when the test runs)


def _qwen_task():
    """An unmodified transformers Qwen3-MoE with its router loss, in a LightningModule (its `labels` loss)."""
    import lightning.pytorch as pl

    transformers = pytest.importorskip("transformers")

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_qwen3_moe(
                transformers,
                output_router_logits=ROUTER[0],
                router_aux_loss_coef=0.05,
                experts_implementation="eager",
            )

        def dry_run_batch(self, n: int, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, 32, (n, seq_len or 16))
            return ids, ids

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Task


def test_a_transformers_moe_with_its_router_loss_dry_runs_under_a_pipeline(fake_world):
    from lightning_dist import _compat
    from lightning_dist.dryrun import DryRunConfig, simulate_rank

    if not _compat.torch_pipelining_exchanges_meta():
        pytest.skip("torch's stage metadata exchange is needed by the pipeline dry run (torch >= 2.13)")
    globals()["QwenMoETask"] = _qwen_task()
    config = DryRunConfig(
        model=f"{__name__}.QwenMoETask",
        strategy="pipeline_1f1b",
        strategy_args={"pp": 2, "n_microbatches": 2},
        world_size=4,
        devices_per_node=4,
        precision="32-true",
        batch_size=4,
    )
    result = simulate_rank(config, 3)
    calls = {(c["op"], c["dim"]): c for c in result["collectives"]}
    # the counting pass: the statistics summed over the stage's layers (4 experts: 2E + 1 float64 numbers) over
    # dp_shard, then over pp (with the returned loss's terms: float32)
    assert calls[("all_reduce", "dp_shard")] == {**calls[("all_reduce", "dp_shard")], "calls": 1, "payload_bytes": 72}
    assert calls[("all_reduce", "pp")]["payload_bytes"] == 72 + 4
