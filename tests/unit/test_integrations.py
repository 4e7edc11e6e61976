"""Each patch of `lightning_dist._integrations` on its own, and the version predicates that guard them."""

from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_dist import _compat
from lightning_dist._integrations import lightning as lightning_patches

needs_deepspeed = pytest.mark.skipif(not _compat.deepspeed_available(), reason="DeepSpeed is not installed")


# ---- predicates ------------------------------------------------------------------------------------------
def test_untested_releases_are_refused_with_the_range():
    _compat.require_tested_deepspeed("a patch", version="0.19.8")
    _compat.require_tested_lightning("a patch", version="2.6.6")
    with pytest.raises(RuntimeError, match=r"a patch .*deepspeed>=0\.19\.0,<0\.20\.0; found deepspeed 0\.20\.1"):
        _compat.require_tested_deepspeed("a patch", version="0.20.1")
    with pytest.raises(RuntimeError, match=r"deepspeed>=0\.19\.0,<0\.20\.0; found deepspeed 0\.18\.9"):
        _compat.require_tested_deepspeed("a patch", version="0.18.9")
    with pytest.raises(RuntimeError, match=r"lightning>=2\.6\.0,<2\.7\.0; found lightning 2\.7\.0"):
        _compat.require_tested_lightning("a patch", version="2.7.0")


def test_pyproject_bounds_deepspeed_to_the_tested_range():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    lo, hi = _compat.DEEPSPEED_RANGE
    assert f"deepspeed>={lo[:-2]},<{hi[:-2]}" in extras["deepspeed"]


# ---- DeepSpeed -------------------------------------------------------------------------------------------
@needs_deepspeed
def test_initialize_gets_a_device_rank_for_one_call(monkeypatch):
    import deepspeed

    from lightning_dist._integrations.deepspeed import initialize_with_device_rank

    seen = []

    def initialize(*args, **kwargs):
        seen.append(kwargs["args"].device_rank)
        return "engine"

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    with initialize_with_device_rank(3):
        assert deepspeed.initialize(args=argparse.Namespace(device_rank=None)) == "engine"
        deepspeed.initialize(args=argparse.Namespace(device_rank=1))  # a real index is kept
    assert seen == [3, 1]
    assert deepspeed.initialize is initialize  # swapped back


def test_missing_bit16_restore_becomes_a_no_op():
    from lightning_dist._integrations.deepspeed import tolerate_missing_bit16_restore

    evaluation = SimpleNamespace()
    tolerate_missing_bit16_restore(evaluation)
    assert evaluation._restore_from_bit16_weights() is None
    own = SimpleNamespace(_restore_from_bit16_weights=lambda: "own")
    tolerate_missing_bit16_restore(own)
    assert own._restore_from_bit16_weights() == "own"  # DeepSpeed's own method is never replaced
    tolerate_missing_bit16_restore(None)  # no ZeRO object at all: nothing to do


@needs_deepspeed
def test_nvme_checkpoint_methods_replace_only_zero3s():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from lightning_dist._integrations import deepspeed as ds_patches

    other = SimpleNamespace(optimizer=SimpleNamespace())
    ds_patches.self_contained_nvme_checkpoints(other)
    assert not hasattr(other, "zero_nvme_offload_optimizer") and vars(other.optimizer) == {}
    zero = object.__new__(DeepSpeedZeroOptimizer_Stage3)  # the methods are bound, nothing else is touched
    engine = SimpleNamespace(optimizer=zero, zero_nvme_offload_optimizer=lambda: True)
    ds_patches.self_contained_nvme_checkpoints(engine)
    assert zero._rigid_state_dict.__func__ is ds_patches._nvme_rigid_state_dict
    assert zero._rigid_load_state_dict.__func__ is ds_patches._nvme_rigid_load_state_dict
    assert engine.zero_nvme_offload_optimizer() is False  # the swap folder is no longer copied


def test_repointed_lr_scheduler_steps_the_new_optimizer_without_warning():
    from lightning_dist._integrations.deepspeed import repoint_lr_scheduler

    params = [torch.nn.Parameter(torch.ones(2))]
    old = torch.optim.SGD(params, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.5)
    new = torch.optim.SGD(old.param_groups, lr=1.0)
    repoint_lr_scheduler(scheduler, new)
    params[0].grad = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the step was overridden after the scheduler started
        new.step()
        scheduler.step()
    assert scheduler.optimizer is new and new.param_groups[0]["lr"] == 0.5
    assert torch.equal(params[0].detach(), torch.zeros(2))


def test_zero_state_tensors_by_kind():
    from lightning_dist._integrations.deepspeed import zero_state_tensors

    module = torch.nn.Linear(2, 2)
    weight = module.weight
    weight.ds_tensor = torch.zeros(3)  # ZeRO-3's partition of this rank
    master, moment, flat_grads = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    master.grad = torch.ones(3)
    inner = SimpleNamespace(state={master: {"exp_avg": moment, "step": 1}})
    zero = SimpleNamespace(
        fp32_partitioned_groups_flat=[master], optimizer=inner, grad_partitions_flat_buffer=flat_grads
    )
    got = zero_state_tensors(SimpleNamespace(optimizer=zero, module=module))
    assert got["parameters"][:2] == [weight, module.bias] and got["parameters"][2] is weight.ds_tensor
    assert got["parameters"][3] is None  # the bias has no partition attribute
    assert got["gradients"][-2] is master.grad and got["gradients"][-1] is flat_grads
    assert got["optimizer"] == [master, moment]  # the int step is not a tensor


def test_param_partitions_and_swappers():
    from lightning_dist._integrations.deepspeed import param_partition_numels, param_swappers

    model = torch.nn.Linear(5, 2)  # weight 10 elements, bias 2
    assert param_partition_numels(model, 4) == [3, 1]  # ceil(numel / world) before partitioning
    model.weight.ds_tensor = SimpleNamespace(ds_numel=7)
    assert param_partition_numels(model, 4) == [7, 1]
    swapper = object()
    model.weight.nvme_swapper = model.bias.nvme_swapper = swapper
    assert param_swappers(model) == [swapper]  # one per distinct swapper


# ---- Lightning -------------------------------------------------------------------------------------------
def test_module_device_mesh_is_set():
    from lightning.pytorch import LightningModule

    module, mesh = LightningModule(), object()
    lightning_patches.set_module_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_gradient_clipping_is_routed_on_the_instance_only():
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType

    calls = []
    plugin, other = Precision(), Precision()
    lightning_patches.route_gradient_clipping(
        plugin,
        by_norm=lambda opt, clip: calls.append(("norm", opt, clip)),
        by_value=lambda opt, clip: calls.append(("value", opt, clip)),
    )
    # Lightning's own dispatch (Trainer(gradient_clip_val=...), LightningModule.clip_gradients) reaches both
    plugin.clip_gradients("opt", 1.5, GradClipAlgorithmType.NORM)
    plugin.clip_gradients("opt", 0.5, GradClipAlgorithmType.VALUE)
    assert calls == [("norm", "opt", 1.5), ("value", "opt", 0.5)]
    assert "clip_grad_by_norm" not in vars(other) and "clip_grad_by_value" not in vars(other)
    # DeepSpeed's precision plugin ignores clip_gradients (its engine clips by the configured value): routed too
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    ds = DeepSpeedPrecision("32-true")
    lightning_patches.route_gradient_clipping(
        ds, by_norm=lambda opt, clip: calls.append(("ds", opt, clip)), by_value=lambda opt, clip: None
    )
    ds.clip_gradients("opt", 2.0, GradClipAlgorithmType.NORM)
    ds.clip_gradients("opt", 0.0, GradClipAlgorithmType.NORM)  # 0: no clipping, as Lightning's
    assert calls[-1] == ("ds", "opt", 2.0) and len(calls) == 3
    # AMP's own clip_gradients (its fused-optimizer check first) is kept
    from lightning.pytorch.plugins.precision import MixedPrecision

    amp = MixedPrecision("bf16-mixed", "cpu")
    lightning_patches.route_gradient_clipping(amp, by_norm=lambda opt, clip: None, by_value=lambda opt, clip: None)
    assert "clip_gradients" not in vars(amp) and "clip_gradients" in vars(ds)


def test_strategy_methods_wrapped_and_unwrapped():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    tagged = lambda original: lambda loader: ("wrapped", original(loader))  # noqa: E731
    lightning_patches.wrap_strategy_methods(strategy, {"process_dataloader": tagged})
    assert strategy.process_dataloader("loader") == ("wrapped", "loader")
    lightning_patches.unwrap_strategy_methods(strategy, ["process_dataloader", "reduce"])
    assert strategy.process_dataloader("loader") == "loader"  # the class method again


def test_default_launcher_is_replaced_and_others_kept():
    from lightning.fabric.plugins.environments import LightningEnvironment

    default = lightning_patches.SubprocessScriptLauncher(LightningEnvironment(), 1, 1)
    strategy = SimpleNamespace(_launcher=default)
    lightning_patches.replace_default_launcher(strategy, lambda: "ours")
    assert strategy._launcher == "ours"
    lightning_patches.replace_default_launcher(strategy, lambda: "again")  # not Lightning's default: kept
    assert strategy._launcher == "ours"


# ---- torch.distributed -----------------------------------------------------------------------------------
_EXIT_SCRIPT = r"""
import os, sys
import torch.distributed as dist
from lightning_dist._integrations import torch_distributed as td

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
sub = dist.new_group([0])  # a second gloo group: flushed too, after WORLD (creation order)
print("GROUPS", len(td.gloo_groups()), td.gloo_groups()[0] is dist.group.WORLD)
if sys.argv[2] == "failing":
    sys.last_value = RuntimeError("an uncaught exception is ending the script")
td.destroy_process_groups_for_exit(rounds=3)
print("DESTROYED", not dist.is_initialized())
"""


def test_exit_flush_finds_every_gloo_group_then_destroys(tmp_path):
    import subprocess
    import sys

    from _harness import free_port

    from lightning_dist._integrations import torch_distributed as td

    assert _compat.TORCH_GROUP_REGISTRY  # the tested range: the flush is active on this torch
    script = tmp_path / "exit_flush.py"
    script.write_text(_EXIT_SCRIPT)
    for mode in ("healthy", "failing"):
        proc = subprocess.run(
            [sys.executable, str(script), str(free_port()), mode], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "GROUPS 2 True" in proc.stdout, proc.stdout
        assert "DESTROYED True" in proc.stdout, proc.stdout
    if not torch.distributed.is_initialized():  # (another unit test may have left one in this process)
        assert td.gloo_groups() == []  # no process group: nothing to flush
        td.destroy_process_groups_for_exit()  # and no error without one


def test_exit_flush_barriers_each_gloo_backend_before_destroying(monkeypatch):
    from lightning_dist._integrations import torch_distributed as td

    events = []

    class Backend:
        def __init__(self, name):
            self.name = name

        def barrier(self):
            events.append(("barrier", self.name))
            return SimpleNamespace(wait=lambda: None)

    class Group:
        def __init__(self, name):
            self.backend = Backend(name)

        def barrier(self, opts):
            assert opts.device == torch.device("cpu")  # the gloo backend, also in a group where NCCL serves CUDA
            return self.backend.barrier()

    groups = [Group("world"), Group("tp")]
    monkeypatch.setattr(td, "gloo_groups", lambda: groups)
    monkeypatch.setattr(td.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(td.dist, "destroy_process_group", lambda: events.append(("destroy",)))
    monkeypatch.delattr(td.sys, "last_value", raising=False)
    td.destroy_process_groups_for_exit(rounds=2)
    assert events == [("barrier", "world")] * 2 + [("barrier", "tp")] * 2 + [("destroy",)]

    events.clear()  # an uncaught exception is ending the script: peers may be gone, so no barrier
    monkeypatch.setattr(td.sys, "last_value", RuntimeError("boom"), raising=False)
    td.destroy_process_groups_for_exit(rounds=2)
    assert events == [("destroy",)]


@pytest.mark.skipif(not _compat.module_available("torchdata"), reason="torchdata (the `test` extra) is not installed")
def test_stateful_dataloader_gets_a_plain_distributed_sampler_and_resumes_mid_epoch(monkeypatch):
    """Lightning's injection, as its data connector runs it: without the patch torchdata's own RandomSampler
    ends up inside a DistributedSamplerWrapper (order from an unsaved generator); with it, a DistributedSampler,
    and the loader's state_dict resumes the interrupted epoch at the next batch."""
    import warnings

    from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
    from lightning.pytorch.trainer.connectors import data_connector
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    warnings.filterwarnings("ignore", message=".*set_vital.*")
    data = TensorDataset(torch.arange(40.0))

    def injected(rank):
        with _replace_dunder_methods(DataLoader, "dataset"):  # what Lightning does around `train_dataloader()`
            loader = StatefulDataLoader(data, batch_size=3, shuffle=True)
        sampler = data_connector._get_distributed_sampler(
            loader, shuffle=_is_dataloader_shuffled(loader), overfit_batches=0, num_replicas=2, rank=rank
        )
        loader = _update_dataloader(loader, sampler)
        _set_sampler_epoch(loader, 1)
        return loader

    # Lightning's own function for this test (a strategy set up earlier in this process may have patched it)
    current = data_connector._get_distributed_sampler
    lightning_own = getattr(current, "__wrapped__", current)
    monkeypatch.setattr(data_connector, "_get_distributed_sampler", lightning_own)
    assert type(injected(0).batch_sampler.sampler).__name__ == "DistributedSamplerWrapper"  # Lightning alone
    lightning_patches.distributed_sampler_for_stateful_loaders()
    patched = data_connector._get_distributed_sampler
    lightning_patches.distributed_sampler_for_stateful_loaders()
    assert data_connector._get_distributed_sampler is patched  # once per process
    loader = injected(0)
    assert type(loader.batch_sampler.sampler) is DistributedSampler and loader.batch_sampler.sampler.shuffle
    whole = [b[0].tolist() for b in loader]
    assert sorted(sum(whole, [])) != sorted(sum([b[0].tolist() for b in injected(1)], []))  # ranks differ
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    resumed = injected(0)
    resumed.load_state_dict(state)
    assert head + [b[0].tolist() for b in resumed] == whole


_DDP_ON_FAKE_GROUP = """
import pytest, torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import DistributedDataParallel as DDP
from lightning_dist import _compat
from lightning_dist._integrations.torch_distributed import ddp_on_fake_process_group
from lightning_dist.callbacks.ledger import CollectiveRecorder

_compat.init_fake_process_group(rank=1, world_size=2)
init = DDP.__init__
with FakeTensorMode():
    net = torch.nn.Linear(6, 4)
    with pytest.raises(RuntimeError, match="data is not allocated"):
        DDP(net)
    with ddp_on_fake_process_group():
        model = DDP(net)
        with CollectiveRecorder() as rec:
            model(torch.randn(3, 6)).sum().backward()
assert DDP.__init__ is init
assert [(op, nbytes) for op, _, nbytes in rec.calls] == [("all_reduce", (6 * 4 + 4) * 4)], rec.calls  # one bucket
assert net.weight.grad is not None and net.weight.grad.shape == (4, 6)

# composable replicate: its reducer (and DDP's one-time broadcast from rank 0) built before the step, not in it
from torch.distributed._composable.replicate import replicate
from lightning_dist._integrations.torch_distributed import build_replicate_reducers

with FakeTensorMode(), ddp_on_fake_process_group():
    rep = replicate(torch.nn.Linear(6, 4))
    assert replicate.state(rep)._init_args  # torch builds it lazily, at the first forward
    with CollectiveRecorder() as setup:
        build_replicate_reducers(rep)
    assert not replicate.state(rep)._init_args
    assert [(op, nbytes) for op, _, nbytes in setup.calls] == [("broadcast", (6 * 4 + 4) * 4)], setup.calls
    with CollectiveRecorder() as step:
        rep(torch.randn(3, 6)).sum().backward()
    assert [op for op, _, _ in step.calls] == ["all_reduce"], step.calls
    build_replicate_reducers(torch.nn.Linear(2, 2))  # no replicate: left as it is
dist.destroy_process_group()
print("OK")
"""


def test_ddp_runs_on_the_fake_process_group_only_under_its_patch():
    # the dry run of a replicated layout: DDP built on fake tensors and torch's fake group, one step recorded; the
    # patch leaves DDP as it found it (outside it, the same construction fails on its shape check); composable
    # replicate's reducer built ahead of the step by build_replicate_reducers. In a fresh process: the fake group must
    # be the process's default group
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _DDP_ON_FAKE_GROUP], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


_MOE_IN_ONE_GROUP = r"""
import sys, types
import pytest, torch, torch.distributed as dist, transformers as tf
from lightning_dist._integrations import transformers_moe as tm

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
torch.manual_seed(0)
cfg = tf.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=8, output_router_logits=True, router_aux_loss_coef=0.1, experts_implementation="eager")
model = tf.Qwen3MoeForCausalLM(cfg).double()
ids = torch.randint(0, 32, (2, 6))
mask = torch.ones(2, 6, dtype=torch.long); mask[1, -2:] = 0
theirs = model(ids, attention_mask=mask).aux_loss
assert tm.router_loss_in_use(model) == "Qwen3MoeForCausalLM"
with tm.global_router_loss(model, dist.group.WORLD) as swapped:
    ours = model(ids, attention_mask=mask).aux_loss
    assert swapped == ["transformers.models.qwen3_moe.modeling_qwen3_moe"]
assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)  # one rank: the global loss is the model's own
assert sys.modules[swapped[0]].load_balancing_loss_func.__qualname__ == "load_balancing_loss_func"  # restored
# a modeling module whose router loss is another formula: refused, not replaced
module = sys.modules[swapped[0]]
original = module.load_balancing_loss_func
module.load_balancing_loss_func = lambda *a, **k: original(*a, **k) * 2
tm._CHECKED.clear()
with pytest.raises(RuntimeError, match="not the Switch-Transformer load-balancing loss"):
    with tm.global_router_loss(model, dist.group.WORLD):
        model(ids, attention_mask=mask)
print("OK")
"""


def test_global_router_loss_is_the_models_own_on_one_rank_and_refuses_another_formula():
    import subprocess
    import sys

    pytest.importorskip("transformers")
    from tests._harness import free_port

    out = subprocess.run(
        [sys.executable, "-c", _MOE_IN_ONE_GROUP, str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


_DTENSOR_CACHE = """
import torch, torch.nn.functional as F
from lightning_dist import _compat
from lightning_dist._integrations.torch_distributed import clear_dtensor_sharding_cache

_compat.init_fake_process_group(rank=0, world_size=2)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

mesh = init_device_mesh("cpu", (2,))
w = distribute_tensor(torch.randn(64, 32, dtype=torch.float64), mesh, [Shard(0)])  # a vocab-parallel embedding
ids = DTensor.from_local(torch.randint(0, 64, (2, 4)), mesh, [Replicate()])
scale = 32**0.5
F.embedding(ids, w) * scale  # BioGPT scales its embedding by a Python float
try:
    F.embedding(ids, w) * torch.tensor(scale, dtype=torch.float64)  # Gemma by a 0-dim tensor
    print("no collision")
except AttributeError as err:
    assert "has no attribute 'mesh'" in str(err), err
    print("collision")
clear_dtensor_sharding_cache()
F.embedding(ids, w) * scale
clear_dtensor_sharding_cache()
assert (F.embedding(ids, w) * torch.tensor(scale, dtype=torch.float64)).shape == (2, 4, 32)
print("OK")
"""


def test_a_cleared_dtensor_cache_lets_a_second_model_scale_its_embedding_otherwise():
    # torch 2.13-2.14's DTensor fast-path cache takes a 0-dim tensor argument for the float it cached (a second HF model
    # in one process refused: "'float' object has no attribute 'mesh'"); every parallelization clears it first
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _DTENSOR_CACHE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]
    if torch.__version__ >= (2, 13):
        assert run.stdout.startswith("collision"), run.stdout  # what the clear is for, still there on this torch
