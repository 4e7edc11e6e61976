"""PipelineStrategy against single-device training, float64 (run under torchrun with 2 or 4 processes).

2 processes (pp=2): every schedule; accumulate_grad_batches=2 + gradient clipping + LR scheduler;
validation through the pipeline; checkpoint resume and consolidation into a single-device model;
bad configurations raising on every rank; issue 20's silent cases (a forward with residual adds outside
its children, an L2 term in training_step, a loss scaling the output term, a Linear used twice in one stage).
4 processes: every schedule with pp=4, pp=2 x dp=2 (FSDP2 on dp), and pp=2 x tp=2 (tensor parallelism inside
each stage, with global-norm clipping over DTensor and plain gradients). 8 processes ("3d"): pp=2 x dp=2 x tp=2.
Each rank compares the parameters it holds with the reference (keys are the single-device names). The 1F1B fit of
pp=2 also lists the package's modules its steady-state steps enter (issue 40: one owner per step).
"""

import os
import sys
import tempfile
import threading

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import MLP, Classifier, dataset, emit, full_params, trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning_dist  # noqa: F401  (registers the strategies)
import lightning_dist.callbacks
from lightning_dist import checkpoint as ckpt
from lightning_dist.strategies import PipelineStrategy

DEPTH = 8
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
# TP inside the stages of the MLP: gathered column-parallel stem and blocks, a row-parallel head fed whole
# inputs (5 outputs do not split over 2 ranks, 16 inputs do)
TP_PLAN = {
    "stem": "colwise_gather",
    "blocks.*.fc": "colwise_gather",
    "head": {"style": "rowwise", "input": "replicate"},
}


class PipeClassifier(Classifier):
    """The Classifier plus the PipelineStrategy contract and a validation loop through the network."""

    def __init__(self, *, micro: int = 4, **kw) -> None:
        kw.setdefault("depth", DEPTH)
        super().__init__(**kw)
        self.example_input_array = torch.randn(micro, 12, dtype=torch.float64)
        self.step_losses: list[float] = []
        self.out_shapes: list[list[int]] = []

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)

    def training_step(self, batch, batch_idx):
        x, y = batch  # the pattern every pp rank serves: the loss through pipeline_loss (a scalar on each rank)
        out = self(x)
        self.out_shapes.append([len(x), *out.shape])  # the stand-in's shape: the whole batch's output, on every rank
        loss = self.pipeline_loss(out, y)
        self.log("train_loss", loss, sync_dist=True)
        self.step_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch)

    def val_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(dataset(self.n, dtype=self.dtype_, seed=2), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=self.global_batch // kw["num_replicas"], sampler=sampler)


def reference(steps, *, accumulate=1, clip=None, schedule=False, n=96, global_batch=16):
    """Single-device AdamW on the global batch (Lightning's order, loss / accumulate, clipping, StepLR)."""
    torch.manual_seed(0)
    model = MLP(depth=DEPTH).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    data, per_epoch, b, losses, clipped = dataset(n), n // global_batch, 0, [], []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            j, b = b % per_epoch, b + 1
            x, y = data[j * global_batch : (j + 1) * global_batch]
            loss = F.cross_entropy(model(x), y)
            losses.append(loss.item())
            (loss / accumulate).backward()
        if clip:
            clipped.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() > clip)
        opt.step()
        if sched:
            sched.step()
    val = dataset(n, seed=2)
    with torch.no_grad():
        val_loss = sum(
            F.cross_entropy(model(val[i : i + global_batch][0]), val[i : i + global_batch][1]).item()
            for i in range(0, n, global_batch)
        ) / (n // global_batch)
    reference.clipped, reference.model = clipped, model  # for the checks that clipping was active / predictions
    return {f"model.{k}": p.detach().clone() for k, p in model.named_parameters()}, losses, val_loss


def local_diff(module, ref) -> tuple[float, list[str]]:
    """Max relative difference of the parameters this rank holds (full tensors of FSDP shards)."""
    from torch.distributed.tensor import DTensor

    worst, keys = 0.0, []
    for name, p in module.named_parameters():
        t = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        worst = max(worst, ((t - ref[name]).norm() / ref[name].norm()).item())
        keys.append(name)
    return worst, keys


def fit(strategy, steps, *, module=None, **kw):
    module = module or PipeClassifier(
        global_batch=kw.pop("global_batch", 16), n=kw.pop("n", 96), schedule=kw.pop("lr_schedule", False)
    )
    t = trainer(strategy, devices=WORLD, steps=steps, num_sanity_val_steps=0, **kw)
    t.fit(module)
    return module, t


def parity(tag, strategy, steps=3, **kw):
    ref, ref_losses, ref_val = reference(
        steps,
        accumulate=kw.get("accumulate_grad_batches", 1),
        clip=kw.get("gradient_clip_val"),
        schedule=kw.get("lr_schedule", False),
    )
    clipped, ref_model = reference.clipped, reference.model
    module, t = fit(strategy, steps, **kw)
    strategy = t.strategy  # a registry name resolves to a PipelineStrategy
    diff, keys = local_diff(module, ref)
    logged = t.callback_metrics["train_loss"].item()  # what self.log(sync_dist=True) and the progress bar show
    metrics = t.validate(module, verbose=False)[0]
    val_x = dataset(module.n, seed=2).tensors[0]
    with torch.no_grad():
        expected = ref_model(val_x[: module.global_batch])
    preds = t.predict(module, DataLoader(val_x[: module.global_batch], batch_size=module.global_batch))
    predict_diff = (torch.cat(preds) - expected).abs().max().item()
    emit(
        kind="parity",
        tag=tag,
        diff=diff,
        keys=keys,
        n_keys=len(ref),
        losses=module.step_losses,
        out_shapes=module.out_shapes,
        ref_losses=ref_losses,
        logged=logged,
        val=metrics["val_loss"],
        ref_val=ref_val,
        split=[list(s.blocks) for s in strategy.split.stages],
        stages=strategy.local_stages,
        shape=list(strategy.mesh.spec.shape),
        clipped=clipped,
        predict_diff=predict_diff,
        schedule=strategy.schedule,
        tp_sharded=sorted(n for n, p in module.named_parameters() if _on_tp(p)),
    )
    return module, t, ref


class ModuleEntries(pl.Callback):
    """The package's modules whose functions run during batches `first`..`last` (steady state: after set-up and the
    schedules' first step), by ``sys.setprofile``: ``entered`` maps each module's path to the functions entered."""

    ROOTS = (
        (os.path.dirname(lightning_dist.__file__) + os.sep, "lightning_dist/"),
        (os.path.dirname(lightning_dist.callbacks.__file__) + os.sep, "lightning_dist/callbacks/"),
    )

    def __init__(self, first: int = 1, last: int = 2) -> None:
        self.first, self.last, self.entered = first, last, {}

    def _profile(self, frame, event, arg) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        for root, name in self.ROOTS:
            if path.startswith(root):
                self.entered.setdefault(name + path[len(root) :], set()).add(frame.f_code.co_name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.first:  # from here: the strategy's on_train_batch_start runs after the callbacks'
            sys.setprofile(self._profile)
            threading.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.last:  # after the optimizer step
            sys.setprofile(None)
            threading.setprofile(None)


def _on_tp(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())


def errors():
    """Bad configurations: every rank raises the same clear error before any collective."""
    cases = {
        "too_many_stages": lambda: PipelineStrategy(
            pp=2, schedule="interleaved_1f1b", stages_per_rank=5, split="params"
        ),
        "few_microbatches": lambda: PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=1, split="params"),
        "indivisible_batch": lambda: PipelineStrategy(pp=2, n_microbatches=3, split="params"),
    }
    for name, make in cases.items():
        try:
            fit(make(), 1)
            emit(kind="error", case=name, message=None)
        except (ValueError, TypeError, RuntimeError) as err:
            emit(kind="error", case=name, type=type(err).__name__, message=str(err))

    class NoLoss(PipeClassifier):
        pipeline_loss = None

    try:
        fit(PipelineStrategy(pp=2, split="params"), 1, module=NoLoss())
        emit(kind="error", case="no_loss_hook", message=None)
    except ValueError as err:
        emit(kind="error", case="no_loss_hook", type=type(err).__name__, message=str(err))

    class Manual(PipeClassifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.automatic_optimization = False

    try:
        fit(PipelineStrategy(pp=2, split="params"), 1, module=Manual())
        emit(kind="error", case="manual_optimization", message=None)
    except ValueError as err:
        emit(kind="error", case="manual_optimization", type=type(err).__name__, message=str(err))


class Residual(nn.Module):
    """Residual adds around each block of its ModuleList, in its own forward (not inside a child module)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def shared_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)  # used twice: weight sharing inside one stage
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(16, 5))


L2 = 1e-2


def single_device(model, steps, *, l2=0.0, global_batch=16):
    """AdamW on one device on the global batch; loss CE (+ l2 * sum of squared parameters)."""
    model = model.double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = dataset(96)
    for k in range(steps):
        x, y = data[k * global_batch : (k + 1) * global_batch]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if l2:
            loss = loss + l2 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    single_device.last_loss = loss.item()  # the last step's loss (penalty included), for the logged-value checks
    return {f"model.{k}": p.detach().clone() for k, p in model.named_parameters()}


def silent_cases():
    """Issue 20's silent pipeline cases: each trains as one device would, or refuses on every rank."""

    class ResidualNoSample(PipeClassifier):  # case 1: no example_input_array -> checked on the first batch
        def __init__(self, sample: bool = False):
            super().__init__()
            self.model = Residual()
            if not sample:
                self.example_input_array = None

    for case, module in (
        ("residual_first_batch", lambda: ResidualNoSample()),
        ("residual_example", lambda: ResidualNoSample(sample=True)),
    ):
        try:
            fit(PipelineStrategy(pp=2, split="params"), 1, module=module())
            emit(kind="silent", case=case, message=None)
        except ValueError as err:
            emit(kind="silent", case=case, type=type(err).__name__, message=str(err))

    class Penalized(PipeClassifier):  # case 5: an L2 term on the parameters in training_step, logged with it
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.pipeline_loss(self(x), y) + L2 * sum(p.pow(2).sum() for p in self.parameters())
            self.log("train_loss", loss, sync_dist=True)
            self.log("penalty_free", self.trainer.strategy.last_loss, sync_dist=True)  # logged as it is
            return loss

    torch.manual_seed(0)
    ref = single_device(MLP(depth=DEPTH), 3, l2=L2)
    ref_loss = single_device.last_loss
    module, t = fit(PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=4, split="params"), 3, module=Penalized())
    emit(
        kind="silent",
        case="l2_penalty",
        diff=local_diff(module, ref)[0],
        without_l2=local_diff(module, single_device(_seeded_mlp(), 3))[0],
        logged=t.callback_metrics["train_loss"].item(),
        ref_loss=ref_loss,
        penalty_free=t.callback_metrics["penalty_free"].item(),
        last_loss=float(t.strategy.last_loss),
    )

    class Scaled(PipeClassifier):  # a term on the output the schedule cannot back-propagate: refused
        def training_step(self, batch, batch_idx):
            x, y = batch
            return 2 * self.pipeline_loss(self(x), y)

    class OutputTerm(PipeClassifier):  # a term on the output outside pipeline_loss: refused on every rank
        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            return self.pipeline_loss(out, y) + 1e-3 * out.pow(2).mean()

    class Direct(PipeClassifier):  # the loss computed from the output values: served only by broadcast_output=True
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

    class DirectScaled(PipeClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return 2 * F.cross_entropy(self(x), y)

    for case, module, kw in (
        ("scaled_output_loss", Scaled, {}),
        ("output_term", OutputTerm, {}),
        ("direct_use", Direct, {}),
        ("direct_scaled_broadcast", DirectScaled, {"broadcast_output": True}),
    ):
        try:
            fit(PipelineStrategy(pp=2, split="params", **kw), 1, module=module())
            emit(kind="silent", case=case, message=None)
        except ValueError as err:
            emit(kind="silent", case=case, type=type(err).__name__, message=str(err))

    # the opt-in: the whole output on every rank, a loss computed from its values, one-device parity
    torch.manual_seed(0)
    ref = single_device(MLP(depth=DEPTH), 3)
    module, t = fit(
        PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=4, split="params", broadcast_output=True),
        3,
        module=Direct(),
    )
    emit(
        kind="silent",
        case="direct_broadcast",
        diff=local_diff(module, ref)[0],
        logged=t.callback_metrics["train_loss"].item(),
    )

    class Shared(PipeClassifier):  # case 7: one nn.Linear used twice, both uses on stage 0
        def __init__(self):
            super().__init__()
            self.model = shared_sequential()

    ref = single_device(shared_sequential(), 3)
    module, t = fit(PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=4, split=[5]), 3, module=Shared())
    emit(
        kind="silent",
        case="shared_linear",
        diff=local_diff(module, ref)[0],
        split=[list(s.blocks) for s in t.strategy.split.stages],
    )


def shared_blocks_dp():
    """pp=2 x dp=2 (FSDP2 per stage): a block used twice in the block list stays with the stage's root unit."""

    def build():
        model = _seeded_mlp()
        model.blocks[1] = model.blocks[0]  # weight sharing inside stage 0
        return model

    class SharedBlocks(PipeClassifier):
        def __init__(self):
            super().__init__()
            self.model = build()

    ref = single_device(build(), 3)
    module, t = fit(
        PipelineStrategy(pp=2, dp_shard=2, schedule="1f1b", n_microbatches=2, split=[4]), 3, module=SharedBlocks()
    )
    emit(
        kind="silent", case="shared_block_dp2", diff=local_diff(module, ref)[0], shape=list(t.strategy.mesh.spec.shape)
    )


def _seeded_mlp():
    torch.manual_seed(0)
    return MLP(depth=DEPTH)


def bubble():
    """PipelineBubble: the recorded action timeline (counts per kind), held micro-batches, logged metrics, PNG."""
    from lightning_dist._compat import matplotlib_available
    from lightning_dist.callbacks.pipeline_bubble import PipelineBubble

    root = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    for schedule in ("1f1b", "gpipe", "zero_bubble"):
        png = os.path.join(root[0], f"{schedule}.png")
        cb = PipelineBubble(gantt_path=png if matplotlib_available() else None, warmup_steps=0)
        strategy = PipelineStrategy(pp=2, schedule=schedule, n_microbatches=4, split="params")
        module = PipeClassifier()
        t = trainer(strategy, devices=WORLD, steps=2, num_sanity_val_steps=0, callbacks=[cb])
        t.fit(module)
        kinds = {}
        for stage, kind, mb, *_ in cb.last_records[dist.get_rank()]["events"]:
            kinds.setdefault(f"{stage}{kind}", []).append(mb)
        emit(
            kind="bubble",
            schedule=schedule,
            kinds={k: sorted(v) for k, v in kinds.items()},
            summary={k: v for k, v in cb.summary().items() if k != "peak_held"},
            peak_held=cb.steps[-1]["peak_held"],
            logged={k: t.callback_metrics[k].item() for k in t.callback_metrics if k.startswith("pipeline/")},
            png=os.path.exists(png) and os.path.getsize(png) if dist.get_rank() == 0 else None,
        )


def ledger():
    """The pp traffic of a step with a wide head (256 outputs, 16x the width 16): boundary activations and their
    gradients, the batch loss (a scalar); no output on the wire. Logged loss: the one-device value on both ranks."""
    from lightning_dist.callbacks import CommunicationLedger

    class Wide(PipeClassifier):
        def __init__(self):
            super().__init__(n_out=256)

    class LateReceive(pl.Callback):
        """The loss's receive posted after the schedule, as under NCCL (which matches no tags), here on gloo."""

        def on_train_start(self, trainer, pl_module):
            trainer.strategy._pipeline.runner.receive_loss_early = False

    rows = {}
    for opt_in in (False, True, "late"):
        cb = CommunicationLedger(planned=None, print_table=False, log=False)
        module, t = fit(
            PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=4, split="params", broadcast_output=opt_in is True),
            3,
            module=Wide(),
            callbacks=[cb, *([LateReceive()] if opt_in == "late" else [])],
        )
        rows[str(opt_in)] = {f"{op}/{dim}": nbytes for (op, dim), (_, nbytes) in cb.per_step().items()}
        rows[f"logged_{opt_in}"] = t.callback_metrics["train_loss"].item()
    emit(kind="ledger", rows=rows, boundary=2 * 4 * (16 // 4) * 16 * 8, output=16 * 256 * 8)


def checkpoint_resume():
    """2 steps with 1F1B, save (sharded); resume interleaved to 4 steps == 4 reference steps; load on 1 device."""
    ref4, _, _ = reference(4, n=32)
    root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "pp2.ckpt")
    module, t = fit(PipelineStrategy(pp=2, schedule="1f1b", split="params"), 2, n=32)
    t.save_checkpoint(path)
    resumed = PipeClassifier(n=32)
    # resumed in another layout (interleaved: 4 stages, rank 0 holds stages 0 and 2): keys are single-device names
    t2 = trainer(
        PipelineStrategy(pp=2, schedule="interleaved_1f1b", split="params"),
        devices=WORLD,
        steps=4,
        num_sanity_val_steps=0,
    )
    t2.fit(resumed, ckpt_path=path)
    diff, _ = local_diff(resumed, ref4)
    t2.save_checkpoint(path + "4")
    single_diff = None
    if dist.get_rank() == 0:
        ckpt.consolidate(path + "4", path + "4.pt")  # no process group: what a single-device user does
        full = torch.load(path + "4.pt", map_location="cpu", weights_only=True)
        single = Classifier(depth=DEPTH).double()
        single.load_state_dict(full[ckpt.MODEL_KEY], strict=True)  # every key present, single-device layout
        # the stages' optimizer states merge into torch's own layout for the single-device model
        torch.optim.AdamW(single.parameters()).load_state_dict(full["optimizer_states"][0])
        single_diff = max(((p - ref4[k]).norm() / ref4[k].norm()).item() for k, p in single.named_parameters())
    # pp=2 -> pp=1: the same sharded directory loads into a non-pipelined FSDP2 run (weights; validate)
    from lightning_dist.strategies import FullyShardStrategy

    flat = PipeClassifier(n=32)
    trainer(FullyShardStrategy(), devices=WORLD, steps=4).validate(flat, ckpt_path=path + "4", verbose=False)
    pp1 = full_params(flat)
    pp1_diff = max(((pp1[k] - ref4[k]).norm() / ref4[k].norm()).item() for k in ref4)
    emit(
        kind="resume",
        diff=diff,
        global_step=t2.global_step,
        single_diff=single_diff,
        stages=t2.strategy.local_stages,
        pp1_diff=pp1_diff,
    )


def tensor_parallel():
    """pp=2 x tp=2: TP applied per stage from one plan; clipping takes the norm over DTensor and plain grads."""
    _, t, ref = parity(
        "pp2xtp2_1f1b",
        PipelineStrategy(pp=2, tp=2, tp_plan=TP_PLAN, schedule="1f1b", n_microbatches=4, split="params"),
        steps=3,
        gradient_clip_val=0.05,
    )
    # the sharded checkpoint (DTensor shards of every stage) consolidates into the single-device model
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "pp2tp2.ckpt")
    t.save_checkpoint(path)
    if dist.get_rank() == 0:
        ckpt.consolidate(path, path + ".pt")
        single = Classifier(depth=DEPTH).double()
        single.load_state_dict(torch.load(path + ".pt", map_location="cpu", weights_only=True)[ckpt.MODEL_KEY])
        emit(
            kind="tp_consolidated",
            diff=max(((p - ref[k]).norm() / ref[k].norm()).item() for k, p in single.named_parameters()),
        )
    parity(
        "pp2xtp2_interleaved_1f1b",
        PipelineStrategy(pp=2, tp=2, tp_plan=TP_PLAN, schedule="interleaved_1f1b", n_microbatches=4, split="params"),
        steps=3,
    )


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "pp2"
    if mode == "pp2":
        parity("pp2_gpipe", "pipeline_gpipe", steps=3)  # by name: pp = all devices, balanced split, m = 2 * pp
        for schedule in SCHEDULES[1:] + ["interleaved_zero_bubble"]:
            entries = ModuleEntries()
            strategy = PipelineStrategy(pp=2, schedule=schedule, n_microbatches=4)
            parity(f"pp2_{schedule}", strategy, steps=3, callbacks=[entries] if schedule == "1f1b" else [])
            if schedule == "1f1b":
                emit(kind="entries", modules={k: sorted(v) for k, v in entries.entered.items()})
        parity(
            "pp2_accum_clip_sched",
            PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=2, split="params"),
            steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
            lr_schedule=True,
        )
        checkpoint_resume()
        ledger()
        bubble()
        errors()
        silent_cases()
    elif mode == "silent":  # also part of "pp2" and "pp4"; alone for a quick look
        silent_cases() if WORLD == 2 else shared_blocks_dp()
    elif mode == "tp":
        tensor_parallel()
    elif mode == "3d":  # 8 processes: pp=2 x dp_shard=2 x tp=2, FSDP2 over TP-sharded stages
        parity(
            "pp2xdp2xtp2_1f1b",
            PipelineStrategy(
                pp=2, dp_shard=2, tp=2, tp_plan=TP_PLAN, schedule="1f1b", n_microbatches=4, split="params"
            ),
            steps=3,
            gradient_clip_val=0.05,
        )
    else:
        for schedule in SCHEDULES:
            parity(f"pp4_{schedule}", PipelineStrategy(pp=4, schedule=schedule, n_microbatches=8), steps=3)
        parity("pp2xdp2_1f1b", PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=4), steps=3)
        parity(
            "pp2xdp2_zero_bubble",
            PipelineStrategy(pp=2, schedule="zero_bubble", n_microbatches=4, split="params"),
            steps=3,
        )
        shared_blocks_dp()
        tensor_parallel()
