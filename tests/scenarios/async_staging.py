"""A background save whose staging copy is still being made while training goes on holds the state at save time.

usage: python async_staging.py OUT      (Lightning's launcher, 2 processes, fsdp2 1x2)

The module's extra state makes the staging copy slow (its deep copy sleeps 0.5 s before the tensors are
copied), so the step after the step-3 save runs its forward and backward while the copy is being made, and
its optimizer step comes long before the copy would finish on its own. The module also counts its forward
calls in a buffer (changed in place by every forward, as BatchNorm's statistics are).

A = 6 steps, no checkpoint; G = the same with `async_checkpoint=True` and a save at step 3 (the callback keeps
this rank's shards of parameters, AdamW states and the buffer at that moment); L = G's checkpoint loaded
(nothing trained): equal to what G kept, bitwise; H = resume from it to step 6: equal to A, bitwise.
Controls, to show the checks can fail: U = G with the strategy's wait for the staging copy turned off (the
optimizer step changes the parameters under the copy), B = G with the buffers not cloned at the save.
"""

import sys
import time
from pathlib import Path

import torch
from _common import Classifier, emit, full_params, trainer
from lightning.pytorch.callbacks import Callback

import lightning_dist.strategies._checkpoints as strategy_checkpoints
from lightning_dist.checkpoint_async import BackgroundWriter
from lightning_dist.strategies import FullyShardStrategy

out = Path(sys.argv[1])
KW = dict(n=48)  # 3 steps of 16 per epoch: the step-3 save is at an epoch end (a plain loader resumes there)


class SlowCopy:
    """Extra state whose staging copy takes 0.5 s; the copy is a plain int (a weights-only load reads it)."""

    def __deepcopy__(self, memo):
        time.sleep(0.5)
        return 0


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))


class Counting(Classifier):
    """The root's extra state comes first in the state dict, the counter (a child after the model) last."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.counter = Counter()

    def forward(self, x):
        self.counter.forwards += 1  # in place, in every forward: a buffer that changes outside the optimizer step
        return super().forward(x)

    def get_extra_state(self):
        return SlowCopy()

    def set_extra_state(self, state):
        assert state == 0, state


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def local_state(module, optimizer) -> dict:
    """This rank's shards of parameters and AdamW states, and the buffer."""
    state = {f"param:{n}": _local(p) for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        for k, v in optimizer.state[p].items():
            state[f"{k}:{n}"] = _local(v)
    state["forwards"] = module.counter.forwards.clone()
    return state


class SaveAt3(Callback):
    def __init__(self, path: Path) -> None:
        self.path, self.kept, self.staging_after_save = path, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            self.kept = local_state(pl_module, trainer.optimizers[0])
            trainer.save_checkpoint(self.path)
            # the save returned while the copy is still being made: the next step overlaps it
            self.staging_after_save = trainer.strategy.checkpoint_writer().staging


def fit(steps, ckpt_path=None, save=None, **strategy_kw):
    module = Counting(**KW)
    t = trainer(FullyShardStrategy(**strategy_kw), devices=2, steps=steps, callbacks=[save] if save else [])
    t.fit(module, ckpt_path=ckpt_path)
    return module, t


def equal(a: dict, b: dict) -> dict:
    return {
        "params_optimizer": all(torch.equal(a[k], b[k]) for k in a if k != "forwards"),
        "buffer": torch.equal(a["forwards"], b["forwards"]),
        "n": len(a),
    }


a6, _ = fit(6)
pa = full_params(a6)
save = SaveAt3(out / "g3.ckpt")
g6, tg = fit(6, save=save, async_checkpoint=True)
loaded, tl = fit(3, ckpt_path=out / "g3.ckpt")
h6, th = fit(6, ckpt_path=out / "g3.ckpt", async_checkpoint=True)
pg, ph = full_params(g6), full_params(h6)

real_wait = BackgroundWriter.wait_staged
BackgroundWriter.wait_staged = lambda self: None  # control U: nothing waits for the copy
unguarded = SaveAt3(out / "u3.ckpt")
fit(6, save=unguarded, async_checkpoint=True)
BackgroundWriter.wait_staged = real_wait
u_loaded, tu = fit(3, ckpt_path=out / "u3.ckpt")

real_clone = strategy_checkpoints.clone_buffers
strategy_checkpoints.clone_buffers = lambda state, module: state  # control B: buffers staged in place
uncloned = SaveAt3(out / "b3.ckpt")
fit(6, save=uncloned, async_checkpoint=True)
strategy_checkpoints.clone_buffers = real_clone
b_loaded, tb = fit(3, ckpt_path=out / "b3.ckpt")

emit(
    kind="async_staging",
    staging_after_save=save.staging_after_save,
    checkpointing_changes_nothing=all(torch.equal(pa[k], pg[k]) for k in pa),
    loaded=equal(local_state(loaded, tl.optimizers[0]), save.kept),
    loaded_step=tl.global_step,
    resumed_bitwise=all(torch.equal(pa[k], ph[k]) for k in pa),
    resumed_step=th.global_step,
    forwards=[int(save.kept["forwards"]), int(loaded.counter.forwards), int(h6.counter.forwards)],
    control_unguarded=equal(local_state(u_loaded, tu.optimizers[0]), unguarded.kept),
    control_unguarded_staging=unguarded.staging_after_save,
    control_uncloned=equal(local_state(b_loaded, tb.optimizers[0]), uncloned.kept),
)
