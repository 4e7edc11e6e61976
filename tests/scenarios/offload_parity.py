"""OffloadStrategy against single-device AdamW (float32, 2 processes, 3 steps), plus checkpoint resume.

Usage: ``offload_parity.py COMBOS [--resume COMBOS] [--fsdp2]`` under torchrun, or with ``--devices 2``
for Lightning's own launcher. COMBOS is a comma list of ``stage:optimizer:parameters`` (``-`` = None),
e.g. ``3:cpu:-,3:nvme:nvme``; ``nvme`` uses a fresh folder under ``--nvme-root``.

Each rank prints RESULT lines: ``parity`` (max rel diff vs the reference, the DDP diff on the same
work), ``report`` (the offload report rows), ``resume`` per ``--resume`` combo (6 steps straight vs
3 steps + checkpoint + a new run resumed from it to step 6; a run that saves at step 3 and goes on,
vs the straight one; the step-3 checkpoint consolidated and loaded on a single device), ``evaluate``
per ``--evaluate`` combo (``validate`` and ``test`` alone, without ``fit``, and ``validate`` from a
step-3 checkpoint in a new run, against the single-device loss), ``bf16`` per ``--bf16`` combo
(``bf16-mixed`` training against the same run without offload, and against the float32 reference),
``clip`` per ``--clip`` combo (SGD with ``Trainer(gradient_clip_val=...)`` and with ``self.clip_gradients`` in
manual optimization, against torch's ``clip_grad_norm_`` on one device; clipping by value refused clearly).
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from _common import MLP, Classifier, dataset, emit, full_params, max_rel_diff, reference, trainer, whole_params
from torch.utils.data import DataLoader, DistributedSampler

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.strategies import FSDP2OffloadStrategy, OffloadStrategy

STEPS = 3
parser = argparse.ArgumentParser()
parser.add_argument("combos", nargs="?", default="")
parser.add_argument("--devices", type=int, default=None, help="Lightning's launcher: number of processes")
parser.add_argument("--nvme-root", default=None)
parser.add_argument("--resume", default="", help="combos to save at step 3 and resume to step 6")
parser.add_argument("--fsdp2", action="store_true")
parser.add_argument("--no-ddp", action="store_true")
parser.add_argument("--evaluate", default="", help="combos to validate/test without fit, and from a checkpoint")
parser.add_argument("--bf16", default="", help="combos to train with bf16-mixed")
parser.add_argument("--clip", default="", help="combos to train with gradient-norm clipping (Trainer's and manual)")
args = parser.parse_args()
devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
nvme_root = args.nvme_root or tempfile.gettempdir()


def make(combo: str, tag: str, **kw) -> OffloadStrategy:
    stage, opt, par = combo.split(":")
    opt, par = (None if v == "-" else v for v in (opt, par))
    nvme = None
    if "nvme" in (opt, par):
        nvme = os.path.join(nvme_root, f"nvme-{tag}-{stage}-{opt}-{par}")
        if os.path.isdir(nvme_root):  # a missing root stays missing: the strategy must refuse it
            os.makedirs(nvme, exist_ok=True)
    return OffloadStrategy(optimizer=opt, parameters=par, zero_stage=int(stage), nvme_path=nvme, **kw)


# DeepSpeed keeps tensors under 1 MiB in memory even with NVMe offload: NVMe combos use a wider MLP
WIDE = dict(width=1024, depth=2)
_refs, _ddp = {}, {}


def size_of(combo: str) -> dict:
    return WIDE if "nvme" in combo else {}


def ref_and_ddp(model_kw: dict) -> tuple[dict, float]:
    """The single-device float32 reference and Lightning DDP's diff to it on the same work (cached)."""
    key = tuple(sorted(model_kw.items()))
    if key not in _refs:
        _refs[key] = reference(STEPS, dtype=torch.float32, **model_kw)
        _ddp[key] = None
        if not args.no_ddp:
            module = Classifier(dtype=torch.float32, **model_kw)
            trainer("ddp", devices=devices, steps=STEPS, precision="32-true").fit(module)
            _ddp[key] = max_rel_diff(full_params(module), _refs[key])
    return _refs[key], _ddp[key]


for combo in filter(None, args.combos.split(",")):
    ref32, ddp_diff = ref_and_ddp(size_of(combo))
    strategy = make(combo, "parity")
    module = Classifier(dtype=torch.float32, **size_of(combo))
    trainer(strategy, devices=devices, steps=STEPS, precision="32-true").fit(module)
    diff = max_rel_diff(whole_params(module), ref32)
    rows = strategy.print_report("after the test")
    emit(kind="parity", combo=combo, diff=diff, ddp=ddp_diff, seen=module.seen)
    emit(kind="report", combo=combo, rows=rows)

if args.fsdp2:
    ref32, ddp_diff = ref_and_ddp({})
    strategy = FSDP2OffloadStrategy(optimizer="cpu", parameters="cpu")
    module = Classifier(dtype=torch.float32)
    trainer(strategy, devices=devices, steps=STEPS, precision="32-true").fit(module)
    emit(
        kind="fsdp2",
        type=type(strategy).__name__,
        diff=max_rel_diff(full_params(module), ref32),
        ddp=ddp_diff,
        pin=strategy.offload_policy.pin_memory,
        rows=strategy.print_report("after the test"),
    )

if args.resume:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

for combo in filter(None, args.resume.split(",")):
    total, name = 6, combo.replace(":", "-")
    kw = dict(dtype=torch.float32, n=48, **size_of(combo))  # 3 steps per epoch: checkpoint at an epoch boundary
    straight = Classifier(**kw)
    trainer(make(combo, "straight", report=False), devices=devices, steps=total, precision="32-true").fit(straight)
    want = whole_params(straight)

    def saving(tag: str, steps: int, module: Classifier) -> str:
        """Train `steps` steps saving a checkpoint every 3; the step-3 checkpoint's path."""
        ckpt_dir = os.path.join(nvme_root, f"ckpt-{tag}-{name}")
        cb = ModelCheckpoint(
            dirpath=ckpt_dir,
            filename="step{step}",
            auto_insert_metric_name=False,
            save_top_k=-1,
            every_n_train_steps=STEPS,
        )
        trainer(
            make(combo, tag, report=False),
            devices=devices,
            steps=steps,
            precision="32-true",
            enable_checkpointing=True,
            callbacks=[cb],
        ).fit(module)
        return os.path.join(ckpt_dir, f"step{STEPS}.ckpt")

    # saving swaps offloaded states in and out: it must not change the run that goes on
    continued = Classifier(**kw)
    saving("continued", total, continued)
    first = Classifier(**kw)
    path = saving("first", STEPS, first)
    second = Classifier(**kw, seed=123)  # different init: everything must come from the checkpoint
    trainer(make(combo, "second", report=False), devices=devices, steps=total, precision="32-true").fit(
        second, ckpt_path=path
    )
    got, at_half, on = whole_params(second), whole_params(first), whole_params(continued)  # collectives: every rank
    single = None
    if torch.distributed.get_rank() == 0:
        # single-device load: consolidate the ZeRO shards into one fp32 state dict
        out = os.path.join(nvme_root, f"consolidated-{name}.pt")
        convert_zero_checkpoint_to_fp32_state_dict(path, out)
        plain = Classifier(**kw, seed=7)
        plain.load_state_dict(torch.load(out, weights_only=True)["state_dict"])
        single = max_rel_diff(dict(plain.named_parameters()), at_half)
    ref_kw = {k: v for k, v in kw.items() if k != "n"}
    emit(
        kind="resume",
        combo=combo,
        diff=max_rel_diff(got, want),
        continued=max_rel_diff(on, want),
        steps_seen=second.seen,
        single_device=single,
        straight_vs_ref=max_rel_diff(want, reference(total, n=48, **ref_kw)),
        half_vs_ref=max_rel_diff(at_half, reference(STEPS, n=48, **ref_kw)),
    )


class Evaluated(Classifier):
    """The classifier with validation and test steps over the training data (mean loss, all ranks)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(dataset(self.n, dtype=self.dtype_), shuffle=False, **kw)
        return DataLoader(sampler.dataset, batch_size=8, sampler=sampler)  # equal batches: the mean is the global one

    test_dataloader = val_dataloader


def single_device_loss(params: dict | None, *, n: int, seed: int = 0, **model_kw) -> float:
    """Mean loss over the whole data set on one device, at the initial weights or at `params`."""
    torch.manual_seed(seed)
    model = MLP(**model_kw)
    if params is not None:
        model.load_state_dict({k.removeprefix("model."): v for k, v in params.items()})
    x, y = dataset(n, dtype=torch.float32)[:]
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


if args.evaluate:
    from lightning.pytorch.callbacks import ModelCheckpoint

for combo in filter(None, args.evaluate.split(",")):
    name, kw = combo.replace(":", "-"), dict(dtype=torch.float32, n=48, **size_of(combo))
    model_kw = size_of(combo)
    # validate / test alone: no fit before, the model partitioned by DeepSpeed's evaluation engine
    fresh = Evaluated(**kw)
    t = trainer(make(combo, "evaluate", report=False), devices=devices, steps=STEPS, precision="32-true")
    val = t.validate(fresh, verbose=False)[0]["val_loss"]
    test = t.test(fresh, verbose=False)[0]["test_loss"]
    # validate from a step-3 checkpoint (optimizer state / parameters on NVMe for NVMe combos), in a new run
    ckpt_dir = os.path.join(nvme_root, f"ckpt-evaluate-{name}")
    cb = ModelCheckpoint(
        dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False, save_top_k=-1, every_n_train_steps=STEPS
    )
    trainer(
        make(combo, "evaluate-fit", report=False),
        devices=devices,
        steps=STEPS,
        precision="32-true",
        enable_checkpointing=True,
        callbacks=[cb],
    ).fit(Evaluated(**kw))
    other = Evaluated(**kw, seed=123)  # different init: the weights must come from the checkpoint
    ckpt_val = trainer(
        make(combo, "evaluate-ckpt", report=False), devices=devices, steps=STEPS, precision="32-true"
    ).validate(other, ckpt_path=os.path.join(ckpt_dir, f"step{STEPS}.ckpt"), verbose=False)[0]["val_loss"]
    emit(
        kind="evaluate",
        combo=combo,
        val=val,
        test=test,
        ref=single_device_loss(None, n=48, **model_kw),
        ckpt_val=ckpt_val,
        ckpt_ref=single_device_loss(reference(STEPS, n=48, dtype=torch.float32, **model_kw), n=48, **model_kw),
    )

bf16_base = {}
for combo in filter(None, args.bf16.split(",")):
    # bf16-mixed: bfloat16 parameters in DeepSpeed (swap buffers too), float32 master weights and moments
    model_kw = size_of(combo)
    key = tuple(sorted(model_kw.items()))
    if key not in bf16_base:  # the same run without offload, for this model size
        base = Classifier(dtype=torch.float32, **model_kw)
        trainer(
            OffloadStrategy(optimizer=None, zero_stage=3, report=False),
            devices=devices,
            steps=STEPS,
            precision="bf16-mixed",
        ).fit(base)
        bf16_base[key] = whole_params(base)
    module = Classifier(dtype=torch.float32, **model_kw)
    trainer(make(combo, "bf16", report=False), devices=devices, steps=STEPS, precision="bf16-mixed").fit(module)
    got = whole_params(module)
    emit(
        kind="bf16",
        combo=combo,
        dtype=str(next(iter(got.values())).dtype),
        seen=module.seen,
        vs_no_offload=max_rel_diff(got, bf16_base[key]),
        vs_fp32_ref=max_rel_diff(got, reference(STEPS, dtype=torch.float32, **model_kw)),
    )


CLIP_NORM = 0.3  # below every step's gradient norm: clipping triggers (the reference records it)


class Clipped(Classifier):
    """SGD (the update is the clipped gradient: a wrong norm shows); `manual`: manual optimization calling
    ``self.clip_gradients(opt, CLIP_NORM, algorithm)``."""

    def __init__(self, manual: str = "", **kw) -> None:
        super().__init__(**kw)
        self.manual = manual
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if not self.manual:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
        self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm=self.manual)
        opt.step()
        self.seen += len(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def clipped_reference(clip, **model_kw):
    """One device, float32: torch's clip_grad_norm_ before each SGD step; whether it clipped, per step."""
    torch.manual_seed(0)
    model = MLP(**model_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data, triggered = dataset(96, dtype=torch.float32), []
    for k in range(STEPS):
        x, y = data[k * 16 : (k + 1) * 16]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            triggered.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() > clip)
        opt.step()
    return {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}, triggered


if args.clip:
    ref_clip, triggered = clipped_reference(CLIP_NORM)
    ref_plain, _ = clipped_reference(None)
for combo in filter(None, args.clip.split(",")):
    for manual in ("", "norm"):
        module = Clipped(manual=manual, dtype=torch.float32)
        clip = {} if manual else {"gradient_clip_val": CLIP_NORM}
        trainer(make(combo, "clip", report=False), devices=devices, steps=STEPS, precision="32-true", **clip).fit(
            module
        )
        emit(
            kind="clip",
            combo=combo,
            manual=bool(manual),
            diff=max_rel_diff(whole_params(module), ref_clip),
            triggered=triggered,
            unclipped_diff=max_rel_diff(ref_plain, ref_clip),
            seen=module.seen,
        )
    try:  # DeepSpeed clips by norm only: by value in manual optimization is refused on every rank
        trainer(make(combo, "clip-value", report=False), devices=devices, steps=STEPS, precision="32-true").fit(
            Clipped(manual="value", dtype=torch.float32)
        )
        emit(kind="clip_value", combo=combo, error=None)
    except ValueError as err:
        emit(kind="clip_value", combo=combo, error=str(err))
