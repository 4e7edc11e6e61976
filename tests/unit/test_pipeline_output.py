"""The pipeline's stand-in output and the returned-loss verdict, in one process (no schedule, no collective)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dist.strategies.base import serve_pipeline_loss, unserve_pipeline_loss
from lightning_dist.strategies.pipeline.step import PipelineOutput, check_target, reached_leaves, returned_loss_problem


def loss_leaf(loss: torch.Tensor) -> torch.Tensor:  # the step's batch loss, as the network call returns it
    return loss.detach().clone().requires_grad_()


def _out() -> PipelineOutput:
    return PipelineOutput((4, 8, 4096), torch.float32, torch.device("cpu"), owner="Task", where="training_step", step=1)


def test_stand_in_has_the_shape_and_no_storage():
    out = _out()
    assert out.shape == (4, 8, 4096) and out.dtype == torch.float32 and out.dim() == 3 and len(out) == 4
    assert "held by the last pipeline stage" in repr(out)


@pytest.mark.parametrize(
    "use",
    [
        lambda o: F.cross_entropy(o.flatten(0, 1), torch.zeros(32, dtype=torch.long)),
        lambda o: o * 2,
        lambda o: o.sum(),
        lambda o: o[:, -1],
        lambda o: o.item(),
        lambda o: o.argmax(-1),
        lambda o: torch.cat([o, o]),
        lambda o: o.detach(),
        lambda o: o.float(),
        lambda o: bool(o),
        lambda o: o.tolist(),
    ],
)
def test_every_use_of_the_values_is_refused_with_the_fix(use):
    with pytest.raises(ValueError) as err:
        use(_out())
    msg = str(err.value)
    assert msg.startswith("Task used the pipelined network's output (`") and "in training_step" in msg
    assert "self.pipeline_loss(out, target)" in msg and "out.loss" in msg and "broadcast_output=True" in msg


def test_returned_loss_verdict_on_the_scalar():
    leaf = loss_leaf(torch.tensor(2.5, dtype=torch.float64))
    assert leaf.requires_grad and leaf.is_leaf
    penalty = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    for scale in (1.0, 0.5):
        (d,) = torch.autograd.grad((leaf + 0.1 * penalty.pow(2).sum()) * scale, [leaf])
        assert returned_loss_problem(d, scale, "Task") is None  # a weight penalty added: served
        (d,) = torch.autograd.grad(2 * leaf * scale, [leaf])
        assert "its gradient on that loss is 2 x" in returned_loss_problem(d, scale, "Task")
    assert "does not contain the pipeline's loss" in returned_loss_problem(None, 1.0, "Task")


def test_reached_leaves_are_the_parameters_the_returned_loss_uses():
    lin, other = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    loss = loss_leaf(torch.tensor(1.5))
    assert reached_leaves(loss / 2) == {id(loss)}  # Lightning's division by accumulate_grad_batches: no parameter
    penalised = loss / 2 + 1e-2 * (lin.weight**2).sum() + lin.weight.abs().sum()  # one parameter, reached twice
    assert reached_leaves(penalised) == {id(loss), id(lin.weight)}
    assert id(other.weight) not in reached_leaves(penalised) and id(lin.bias) not in reached_leaves(penalised)
    # backward asks autograd for these only: the gradients equal those over every parameter
    inputs = [loss, lin.weight, lin.bias, other.weight]
    every = torch.autograd.grad(penalised, inputs, allow_unused=True, retain_graph=True)
    asked = [t for t in inputs if id(t) in reached_leaves(penalised)]
    some = dict(zip(map(id, asked), torch.autograd.grad(penalised, asked)))
    for t, g in zip(inputs, every):
        assert (g is None) == (id(t) not in some) and (g is None or torch.equal(g, some[id(t)]))


def test_target_check():
    y = torch.arange(6)
    check_target(y, y, "Task")
    check_target(y, y.clone(), "Task")  # equal values: the same loss
    with pytest.raises(ValueError, match="pipeline_target"):
        check_target(y, y.flip(0), "Task")


def test_serve_and_restore_pipeline_loss():
    class Task(torch.nn.Module):
        def pipeline_loss(self, output, target):
            return F.mse_loss(output, target)

    task, marker = Task(), torch.tensor(7.0)
    stand_in = _out()
    original = serve_pipeline_loss(task, lambda own, out, tgt: marker if out is stand_in else own(out, tgt))
    assert serve_pipeline_loss(task, lambda own, out, tgt: None) is None  # served once: a second server is refused
    assert task.pipeline_loss(stand_in, None) is marker  # the network call's output: the served loss
    x = torch.ones(3)
    assert task.pipeline_loss(x, torch.zeros(3)).item() == 1.0  # any other tensor: the module's own loss
    unserve_pipeline_loss(task, original)
    assert "pipeline_loss" not in task.__dict__ and task.pipeline_loss(x, torch.zeros(3)).item() == 1.0

    task.pipeline_loss = lambda out, tgt: out.sum()  # an instance attribute of the user's is put back
    own = task.pipeline_loss
    original = serve_pipeline_loss(task, lambda own, out, tgt: None)
    assert original is own and task.pipeline_loss is not own
    unserve_pipeline_loss(task, original)
    assert task.pipeline_loss is own
