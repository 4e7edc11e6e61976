"""Activation checkpointing modes (full / selective / every:N), activation offload, their validation and planner
figures."""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_dist import planner
from lightning_dist.models.gpt import GPT
from lightning_dist.parallelize.ac import (
    SELECTIVE_AC_OPS,
    ac_problems,
    apply_ac,
    apply_offload_activations,
    check_offload_device,
    offload_hooks,
    offloaded_bytes,
    parse_ac,
)
from lightning_dist.strategies import (
    AutoParallelStrategy,
    HybridShardStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=17, block_size=16, n_layer=4, n_head=2, n_embd=16).double()


def _grads(model: torch.nn.Module, idx: torch.Tensor) -> list[torch.Tensor]:
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "value,expected",
    [
        (True, ("full", 1, "auto")),
        ("full", ("full", 1, "auto")),
        ("selective", ("selective", 1, "auto")),
        ("every:2", ("full", 2, "auto")),
        (["GPTBlock"], ("full", 1, ("GPTBlock",))),
    ],
)
def test_parse_forms(value, expected):
    plan = parse_ac(value)
    assert (plan.mode, plan.every, plan.units) == expected
    assert parse_ac(False) is None


@pytest.mark.parametrize(
    "value", ["partial", "every:0", "every:x", "every:", "every:²", "every:٣", 3, [], ["GPTBlock", 1]]
)
def test_bad_values_name_the_value_and_the_forms(value):
    with pytest.raises(ValueError, match="activation_checkpointing") as err:
        parse_ac(value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (HybridShardStrategy, {}),
        (TensorParallelStrategy, {"tp": 2}),
        (PipelineStrategy, {"pp": 2}),
        (AutoParallelStrategy, {"device_memory": "1GB"}),
    ],
)
def test_every_strategy_refuses_bad_options_at_construction(cls, kwargs):
    # raised in __init__: before any process group exists, identically on every rank
    with pytest.raises(ValueError, match="every:N"):
        cls(activation_checkpointing="every:-1", **kwargs)
    with pytest.raises(ValueError, match="not torch ops"):
        cls(activation_checkpointing="selective", selective_ac_ops=["aten.no_such_op"], **kwargs)
    with pytest.raises(ValueError, match="selective_ac_ops"):
        cls(activation_checkpointing=True, selective_ac_ops=["aten.mm"], **kwargs)
    with pytest.raises(ValueError, match="no block keeps activations"):
        cls(activation_checkpointing="selective", offload_activations=True, **kwargs)
    s = cls(activation_checkpointing="every:3", offload_activations=True, **kwargs)
    assert s.activation_checkpointing == "every:3" and s.offload_activations is True


def test_default_ops_resolve_and_custom_ops_are_checked():
    assert parse_ac("selective").ops == SELECTIVE_AC_OPS
    assert parse_ac("selective", ops=["aten.mm.default", torch.ops.aten.bmm]).ops[0] == "aten.mm.default"
    assert ac_problems("selective", selective_ops="aten.mm")  # a string, not a list
    assert ac_problems(False, offload_activations="yes")


@pytest.mark.parametrize("mode", ["full", "selective", "every:2"])
def test_modes_give_the_same_gradients_and_wrap_the_expected_blocks(mode):
    base = _gpt()
    idx = torch.randint(0, 17, (3, 16), generator=torch.Generator().manual_seed(1))
    ref = _grads(copy.deepcopy(base), idx)
    model = copy.deepcopy(base)
    plan = parse_ac(mode)
    wrapped = apply_ac(model, mode=plan.mode, every=plan.every)
    assert wrapped == ([model.blocks[1], model.blocks[3]] if mode == "every:2" else list(model.blocks))
    assert list(model.state_dict()) == list(base.state_dict())  # keys unchanged: checkpoints load without AC
    for got, want in zip(_grads(model, idx), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    if mode == "selective":  # a deep copy runs its own forward, not the original's
        twin = copy.deepcopy(model)
        assert twin.blocks[0].forward.__self__ is twin.blocks[0]


def test_selective_keeps_less_than_none_and_more_than_full():
    from torch.distributed._tools.mem_tracker import MemTracker

    base = _gpt()
    idx = torch.randint(0, 17, (8, 16))
    peaks = {}
    for mode in (False, "full", "selective"):
        model = copy.deepcopy(base)
        plan = parse_ac(mode)
        if plan is not None:
            apply_ac(model, mode=plan.mode)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _grads(model, idx)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        peaks[mode] = {str(getattr(k, "value", k)): v for k, v in peak.items()}["Activation"]
    assert peaks["full"] < peaks["selective"] < peaks[False]
    # every second matmul recomputed (torchtitan's rule): the goal is <= 60% of no AC's activations
    assert peaks["selective"] <= 0.6 * peaks[False], peaks


def test_offload_moves_saved_tensors_but_not_parameters_and_keeps_gradients():
    # the CUDA path with the host standing in for the device: pack copies each saved tensor, unpack returns it
    base = _gpt()
    idx = torch.randint(0, 17, (3, 16))
    ref = _grads(copy.deepcopy(base), idx)
    model = copy.deepcopy(base)
    checkpointed = apply_ac(model, every=2)
    hooks = apply_offload_activations(model, skip=checkpointed, pin_memory=False, device_type="cpu")
    assert len(hooks) == 2 and offload_hooks(model) == hooks and offload_hooks(model.blocks[1]) == []
    for got, want in zip(_grads(model, idx), ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    moved = offloaded_bytes(model)
    block_params = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    tokens_c = idx.numel() * 16 * 8  # one [B, T, C] float64 tensor
    assert moved >= 2 * 10 * tokens_c  # at least ten C-sized tensors per block...
    assert moved < 2 * (25 * tokens_c + block_params)  # ...and not the weights on top of everything


def test_offload_is_refused_on_cpu_before_any_collective():
    with pytest.raises(ValueError, match="needs a CUDA device.*nothing to offload"):
        check_offload_device(True, "cpu")
    check_offload_device(False, "cpu")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HybridShardStrategy(offload_activations=True),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    from lightning_dist.models.gpt import CharGPT

    with pytest.raises(ValueError, match="offload_activations=True needs a CUDA device"):
        trainer.fit(CharGPT())
    assert not torch.distributed.is_initialized()


def test_planner_activation_bytes_per_mode():
    block = planner.BlockShape(hidden=64, heads=4, mlp_hidden=256)
    kw = dict(tokens=10, blocks=4, stem=False, head=False)
    none = planner.activation_bytes(block, **kw)
    full = planner.activation_bytes(block, checkpointed="full", **kw)
    assert full == planner.activation_bytes(block, checkpointed=True, **kw)
    sel = planner.activation_bytes(block, checkpointed="selective", **kw)
    every2 = planner.activation_bytes(block, checkpointed="every:2", **kw)
    one = planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False)
    # selective per block: f C + 3 a C + a H + 4 h (a = f = 2, t = 1: q, v, attention output, fc1); one block's
    # rest live again
    kept = 10 * (2 * 64 + 3 * 2 * 64 + 2 * 256 + 16)
    assert sel == 4 * kept + one - kept + 10 * 2 * 64
    assert every2 == 2 * one + 2 * 10 * 2 * 64 + one  # two full blocks, two checkpointed, one recomputed
    assert full < sel < none and full < every2 < none
    assert planner.activation_bytes(block, checkpointed="every:1", **kw) == full
    for bad in ("every:0", "every:²"):  # '²' passes str.isdigit() and fails int(): refused by name, not int()'s error
        with pytest.raises(ValueError, match="every:N"):
            planner.activation_bytes(block, checkpointed=bad, **kw)


class _OffloadedGPT(pl.LightningModule):
    """The GPT with every second block checkpointed and the others offloaded (host standing in for the device)."""

    def __init__(self):
        super().__init__()
        self.model = _gpt().float()

    def configure_model(self):
        checkpointed = apply_ac(self.model, every=2)
        apply_offload_activations(self.model, skip=checkpointed, pin_memory=False, device_type="cpu")

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        return F.cross_entropy(self.model(idx).flatten(0, 1), idx.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randint(0, 17, (8, 16)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_memory_report_shows_the_offloaded_activation_bytes(capsys):
    from lightning_dist.callbacks import MemoryReport

    memory = MemoryReport()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[memory],
    )
    module = _OffloadedGPT()
    trainer.fit(module)
    moved = offloaded_bytes(module.model)
    assert memory.offloaded == moved and moved > 2 * 4 * 16 * 16 * 4  # two blocks' saved tensors, > 1 [B, T, C] each
    assert trainer.callback_metrics["memory/offloaded_activation_bytes"].item() == moved
    assert memory.rows[0]["offloaded_activation_bytes"] == moved
    assert f"none / {moved:,}" in capsys.readouterr().out  # the default strategy has no activation_checkpointing


def test_auto_parallel_hands_the_activation_options_to_its_choice():
    from lightning_dist.strategies.hsdp import FullyShardStrategy

    def layout(kind: str, **mesh: int) -> planner.Layout:
        sizes = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, **mesh}
        memory = planner.MemoryBreakdown(params=0, grads=0, optimizer=0)
        return planner.Layout(name=kind, kind=kind, mesh=sizes, zero_stage=3, memory=memory, traffic=())

    s = AutoParallelStrategy(device_memory="1GB", activation_checkpointing="every:2", selective_ac_ops=None)
    chosen = s.build(layout("fsdp"))
    assert type(chosen) is FullyShardStrategy and chosen.activation_checkpointing == "every:2"
    assert chosen.parallelize_config().activation_checkpointing == "every:2"
    s = AutoParallelStrategy(device_memory="1GB", activation_checkpointing="selective", selective_ac_ops=["aten.mm"])
    chosen = s.build(layout("pp", pp=2))
    assert type(chosen) is PipelineStrategy
    assert chosen.activation_checkpointing == "selective" and chosen.selective_ac_ops == ["aten.mm"]


def test_planner_offloaded_blocks_leave_one_set_on_the_device():
    block = planner.BlockShape(hidden=64, heads=4, mlp_hidden=256)
    kw = dict(tokens=10, blocks=4, stem=False, head=False)
    one = planner.activation_bytes(block, tokens=10, blocks=1, stem=False, head=False)
    assert planner.activation_bytes(block, offloaded=True, **kw) == one
    every2 = planner.activation_bytes(block, checkpointed="every:2", **kw)
    # two checkpointed blocks keep their inputs, the two others go to host memory but one block's set
    assert planner.activation_bytes(block, checkpointed="every:2", offloaded=True, **kw) == every2 - one


@pytest.mark.parametrize("schedule", ["zero_bubble", "interleaved_zero_bubble"])
def test_selective_ac_is_refused_under_zero_bubble_schedules(schedule):
    from lightning_dist.strategies import PipelineStrategy

    # the input- and weight-gradient passes each recompute a block; torch's selective cache serves one backward
    with pytest.raises(ValueError, match=rf"activation_checkpointing='selective' with schedule='{schedule}'"):
        PipelineStrategy(pp=2, schedule=schedule, activation_checkpointing="selective")
    for ok in ("full", "every:2", False):  # recomputed in each pass
        PipelineStrategy(pp=2, schedule=schedule, activation_checkpointing=ok)
    PipelineStrategy(pp=2, schedule="1f1b", activation_checkpointing="selective")


def test_recompute_context_can_be_entered_once_per_backward_pass():
    import contextlib

    from lightning_dist.parallelize.ac import _recompute_under

    entered = []

    @contextlib.contextmanager
    def extra():
        entered.append(1)
        yield

    forward, recompute = _recompute_under(None, extra)()
    for _ in range(2):  # a zero-bubble schedule recomputes in its input- and its weight-gradient pass
        with recompute:
            pass
    assert len(entered) == 2


def test_offload_copies_run_on_the_side_stream_in_order(monkeypatch):
    # CPU stands in for CUDA's stream calls (recorded). Forward: the side stream waits for the compute stream before
    # each copy to host and the saved tensor is marked used by it. Backward: the last block's tensors come back on
    # the compute stream after their copy's event; its backward prefetches the block before it on the side stream,
    # and so on, each prefetched tensor waited for (its event) and marked used by the compute stream. Gradients are
    # bitwise those without offload.
    from torch import nn

    from lightning_dist.parallelize.ac import apply_offload_activations, offloaded_bytes

    log = []

    class Event:
        pass

    class Side:
        def wait_stream(self, other):
            log.append(("side waits", other))

        def record_event(self):
            event = Event()
            log.append(("event", event))
            return event

    class Compute:
        def wait_event(self, event):
            log.append(("compute waits", event))

    side, compute = Side(), Compute()
    monkeypatch.setattr(torch.cpu, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(("in use", stream)))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]).double()
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    net(x).square().sum().backward()
    want = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    x.grad = None
    hooks = apply_offload_activations(net, units=list(net), pin_memory=False, device_type="cpu", stream=side)
    loss = net(x).square().sum()
    forward = list(log)
    copied = [e for kind, e in forward if kind == "event"]
    assert copied and offloaded_bytes(net) == sum(h.bytes for h in hooks) > 0
    for i, (kind, _) in enumerate(forward):  # per saved tensor: wait for compute, copy (marked in use), event
        if kind == "event":
            assert forward[i - 1] == ("in use", side) and forward[i - 2] == ("side waits", compute), forward
    loss.backward()
    backward = log[len(forward) :]
    prefetched = [e for kind, e in backward if kind == "event"]
    waited = [e for kind, e in backward if kind == "compute waits"]
    per_block = len(copied) // 3
    assert len(prefetched) == 2 * per_block  # blocks 1 and 0, each started by the backward of the block after it
    assert {id(e) for e in waited} == {id(e) for e in prefetched} | {id(e) for e in copied[-per_block:]}
    assert sum(1 for entry in backward if entry == ("in use", compute)) == len(prefetched)
    got = [p.grad for p in net.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
