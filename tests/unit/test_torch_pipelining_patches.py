"""Unit tests of each patch of torch pipelining internals (lightning_dist/_integrations/torch_pipelining.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _harness import free_port
from torch import nn

from lightning_dist import _compat
from lightning_dist._integrations.torch_pipelining import TimedStage, drop_p2p_to_self, install_forward_only_program


def test_this_torch_is_a_tested_release_and_others_are_refused(monkeypatch):
    assert _compat.torch_pipelining_tested()  # the suite runs on a release of TORCH_PIPELINING_TESTED
    _compat.check_torch_pipelining("x")
    monkeypatch.setattr(_compat, "torch_pipelining_tested", lambda: False)
    with pytest.raises(
        RuntimeError,
        match=r"patch `install_forward_only_program` uses torch.distributed.pipelining"
        r" internals tested on torch 2.11 to 2.14.x",
    ):
        install_forward_only_program(SimpleNamespace(), [0, 1], 2)


def test_forward_only_program_runs_every_stage_forward_in_order_with_its_sends():
    from torch.distributed.pipelining import schedules as S

    holder = SimpleNamespace()
    install_forward_only_program(holder, stage_ranks=[0, 1, 0, 1], n_microbatches=2)
    program = holder.pipeline_order_with_comms
    assert sorted(program) == [0, 1]
    computes = {
        r: [(a.stage_index, a.microbatch_index) for a in acts if a.computation_type == S._ComputationType.FORWARD]
        for r, acts in program.items()
    }
    assert computes == {0: [(0, 0), (0, 1), (2, 0), (2, 1)], 1: [(1, 0), (1, 1), (3, 0), (3, 1)]}
    kinds = {a.computation_type for acts in program.values() for a in acts}
    assert S._ComputationType.SEND_F in kinds and S._ComputationType.RECV_F in kinds
    assert not kinds & {S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_INPUT}


def test_p2p_to_self_is_dropped_and_the_rest_kept():
    ops = [SimpleNamespace(group_peer=0), SimpleNamespace(group_peer=1), SimpleNamespace(group_peer=0)]
    assert drop_p2p_to_self(ops, 0) == [ops[1]]


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def test_timed_stage_records_each_action(one_rank_group):
    stage = TimedStage(nn.Linear(2, 2).double(), 0, 1, torch.device("cpu"))
    from torch.distributed.pipelining import ScheduleGPipe

    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: o.sum(), scale_grads=False)
    stage.timeline, losses = [], []
    sched.step(torch.randn(4, 2, dtype=torch.float64), target=torch.zeros(4), losses=losses)
    assert [(s, k, mb) for s, k, mb, *_ in stage.timeline] == [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    assert stage.peak_held == 2 and all(end >= start for *_, start, end, _ in stage.timeline)


def test_the_dry_runs_torch_internals_are_checked_against_the_tested_releases(monkeypatch):
    from lightning_dist import _compat

    _compat.check_torch_internals("x")  # this torch is one of the tested releases
    monkeypatch.setattr(_compat, "torch_pipelining_tested", lambda: False)
    with pytest.raises(RuntimeError, match=r"dry run `_step` replaces private parts of torch tested on torch 2\.11"):
        _compat.check_torch_internals("_step")


@pytest.mark.parametrize("keep", [False, True])
def test_a_training_step_keeps_no_output_on_the_last_stage_unless_asked(one_rank_group, keep):
    # keep_output=False (the default of a training step that shows a stand-in): torch's schedule keeps and joins no
    # micro-batch output; the runner returns a meta tensor of the joined output's shape, and the same loss
    import torch.distributed as dist

    from lightning_dist.parallelize.pipeline.schedule import PipelineRunner

    torch.manual_seed(0)
    net = nn.Linear(3, 5).double()
    runner = PipelineRunner([net], [0], [0], schedule="1f1b", device=torch.device("cpu"), group=dist.group.WORLD)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    loss_fn = lambda out, tgt: ((out - tgt) ** 2).mean()  # noqa: E731
    out, loss, _ = runner.step(x, n_microbatches=4, loss_fn=loss_fn, target=y, keep_output=keep)
    ((_, stages),) = runner._schedules.values()
    assert (stages[0].output_chunks == []) is not keep  # torch keeps the micro-batch outputs only when asked
    assert out.shape == (8, 5) and out.dtype == torch.float64 and out.is_meta is not keep
    if keep:
        torch.testing.assert_close(out, net(x), rtol=0, atol=1e-15)
    torch.testing.assert_close(loss, loss_fn(net(x), y), rtol=1e-14, atol=0)  # the micro-batches' mean = the batch's


class _Peer:
    """What the dry run's peer answers: one micro-batch's input of a stage (here 3 x 2 float64)."""

    def stage_input(self, stage):
        return (3, 2), torch.float64

    def last_stage_meta(self, key):
        raise AssertionError("the runner asks for this, not the stages")


@pytest.mark.skipif(
    not _compat.torch_pipelining_exchanges_meta(),
    reason="this torch's pipeline stages infer shapes by running (no metadata exchange for a peer to answer)",
)
def test_a_stage_with_a_peer_takes_the_metadata_from_it_and_sends_none(one_rank_group):
    from torch.distributed.pipelining import ScheduleGPipe

    from lightning_dist._integrations.torch_pipelining import peer_answered

    stage = TimedStage(nn.Linear(2, 2).double(), 0, 1, torch.device("cpu"), peer=_Peer())
    cls = peer_answered(ScheduleGPipe)
    assert issubclass(cls, ScheduleGPipe) and peer_answered(ScheduleGPipe) is cls  # one class per schedule class
    sched = cls(stage, n_microbatches=2, loss_fn=lambda o, t: o.sum(), scale_grads=False)
    losses = []
    sched.step(torch.randn(4, 2, dtype=torch.float64), target=torch.zeros(4), losses=losses)
    assert len(losses) == 2 and stage._inference_mode is not None  # the mode set from this rank's own stage's vote
    # the previous stage's output, as the peer answers it: this stage's input
    (meta,) = stage._recv_meta(-1).forward_metas
    assert tuple(meta.shape) == (3, 2) and meta.dtype == torch.float64 and meta.requires_grad
    # the next stage's input gradient: the shape of this stage's output (a micro-batch of 2 rows)
    (grad,) = stage._recv_meta(1).backward_metas
    assert tuple(grad.shape) == (2, 2) and not grad.requires_grad
    stage._send_meta(object(), 1)  # not sent: the 1-rank group has no stage 1 to send to


def test_the_peer_answered_schedule_is_refused_on_an_untested_torch(monkeypatch):
    from lightning_dist._integrations.torch_pipelining import peer_answered

    monkeypatch.setattr(_compat, "torch_pipelining_tested", lambda: False)
    with pytest.raises(RuntimeError, match=r"patch `peer_answered` uses torch.distributed.pipelining internals"):
        peer_answered(type("Schedule", (), {}))
