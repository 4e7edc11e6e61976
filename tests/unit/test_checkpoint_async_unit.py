"""Background (async) sharded saves in one process (a 1-rank gloo group on a file store, no network):
staged copy, commit only after the write, deferred removals, failures kept visible."""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dist import checkpoint as ckpt
from lightning_dist.checkpoint_async import BackgroundWriter, local_tensor_bytes


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state(model, opt):
    return {
        "state_dict": ckpt.model_state(model, full=False),
        "optimizer_states": [ckpt.optimizer_state(model, opt, full=False)],
        "global_step": 1,
    }


def _trained():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_save_returns_before_commit_and_writes_the_staged_values(tmp_path, one_rank, monkeypatch):
    model, opt = _trained()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "last.ckpt"
    gate, committed = threading.Event(), []
    real_swap = ckpt._swap_in

    def gated_swap(tmp, dst):  # the commit waits until the test lets it go
        assert gate.wait(30)
        real_swap(tmp, dst)
        committed.append(dst)

    monkeypatch.setattr(ckpt, "_swap_in", gated_swap)
    writer = BackgroundWriter()
    ckpt.save(_state(model, opt), path, sharded=True, writer=writer)
    # returned while the save is pending: nothing under `path` yet, the staged copy belongs to the writer
    # (meta.pt, serialized at the save, is written in the background before the commit)
    assert writer.pending and not path.exists()
    assert writer.staging_bytes == local_tensor_bytes(_state(model, opt)) > 0
    writer.wait_staged()  # what the strategy does before the optimizer step: the staging copy is made
    assert not writer.staging and writer.pending
    with torch.no_grad():  # training goes on and changes the parameters in place
        for p in model.parameters():
            p.add_(1.0)
    removed = []
    assert writer.defer(lambda: removed.append(True))
    assert not removed
    gate.set()
    writer.wait()
    assert committed == [path] and removed == [True] and not writer.pending
    fresh = nn.Linear(4, 3)
    meta = ckpt.load(path, model=fresh, optimizers=[torch.optim.Adam(fresh.parameters(), lr=0.1)])
    assert meta["global_step"] == 1
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)  # the values at save time
    assert not writer.defer(lambda: None)  # nothing pending: nothing deferred
    writer.close()


def test_failed_background_save_keeps_previous_checkpoint_and_raises_at_wait(tmp_path, one_rank, monkeypatch):
    model, opt = _trained()
    path = tmp_path / "last.ckpt"
    writer = BackgroundWriter()
    ckpt.save(_state(model, opt), path, sharded=True, writer=writer)
    writer.wait()
    good = sorted(p.name for p in path.iterdir())

    def broken_swap(tmp, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_swap_in", broken_swap)
    ckpt.save(_state(model, opt), path, sharded=True, writer=writer)
    removed = []
    writer.defer(lambda: removed.append(True))
    with pytest.raises(RuntimeError, match="background checkpoint save of .*last.ckpt failed.*disk full"):
        writer.wait()
    assert not removed  # a failed save removes nothing
    assert sorted(p.name for p in path.iterdir()) == good
    ckpt.check_sharded(path)
    # after a failed run the error is logged, not raised
    ckpt.save(_state(model, opt), path, sharded=True, writer=writer)
    writer.wait(raise_errors=False)
    with pytest.raises(ValueError, match="needs sharded checkpoints"):
        ckpt.save(_state(model, opt), tmp_path / "one.ckpt", sharded=False, writer=writer)
    writer.close()
