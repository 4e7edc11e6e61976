"""OffloadStrategy in one process: plan validation, state estimates, NVMe path checks, the report."""

import os

import pytest
import torch
from _harness import needs_deepspeed

from lightning_dist._compat import CUDA_AVAILABLE
from lightning_dist.parallelize import offload as off
from lightning_dist.strategies import REGISTERED, FSDP2OffloadStrategy, OffloadStrategy

MiB = 1 << 20


def test_plan_lists_every_problem_at_once():
    plan = off.OffloadPlan(optimizer="disk", parameters="cpu", zero_stage=2, nvme_path=None)
    with pytest.raises(ValueError) as err:
        plan.validate()
    msg = str(err.value)
    assert "`optimizer='disk'`" in msg
    assert "zero_stage=3" in msg and "`zero_stage=2`" in msg  # parameter offload needs stage 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"parameters": "cpu", "zero_stage": 1}, "`zero_stage=1`"),
        ({"optimizer": "nvme", "zero_stage": 2, "nvme_path": "/x"}, "ZeRO-Infinity"),
        ({"optimizer": "nvme"}, "needs `nvme_path=`"),
        ({"optimizer": "cpu", "nvme_path": "/x"}, 'nothing is offloaded to "nvme"'),
        ({"zero_stage": 4}, "`zero_stage=4`"),
        ({"backend": "megatron"}, "`backend='megatron'`"),
        ({"backend": "fsdp2", "optimizer": "nvme", "parameters": "nvme", "nvme_path": "/x"}, "host memory only"),
        ({"backend": "fsdp2", "optimizer": "cpu", "parameters": None}, "together"),
    ],
)
def test_plan_rejects(kwargs, needle):
    with pytest.raises(ValueError, match="Invalid offload configuration") as err:
        off.OffloadPlan(**kwargs).validate()
    assert needle in str(err.value)


def test_strategy_rejects_bad_input_at_construction():
    with pytest.raises(ValueError, match="`zero_stage=2`"):
        OffloadStrategy(parameters="cpu", zero_stage=2)
    with pytest.raises(ValueError, match="nvme_path"):
        OffloadStrategy(optimizer="nvme", parameters="nvme")


def test_estimate_zero_arithmetic():
    n, world = 1000, 4
    # ZeRO-3, optimizer -> cpu: parameter shard on device, fp32 grads + 12 B/param optimizer on host
    est = off.estimate_states(n, plan=off.OffloadPlan(optimizer="cpu", zero_stage=3), world_size=world)
    assert est.table["parameters"] == {"device": 250 * 4, "host": 0, "nvme": 0}
    assert est.table["gradients"] == {"device": 0, "host": 250 * 4, "nvme": 0}
    assert est.table["optimizer"] == {"device": 0, "host": 250 * 12, "nvme": 0}
    # ZeRO-1: full parameters and gradients, only the optimizer state is sharded
    est1 = off.estimate_states(n, plan=off.OffloadPlan(optimizer="cpu", zero_stage=1), world_size=world)
    assert est1.total(kind="parameters") == n * 4 and est1.total(kind="gradients") == n * 4
    # ZeRO-Infinity, bf16 parameters: everything but gradients on disk; uneven shards round up
    plan = off.OffloadPlan(optimizer="nvme", parameters="nvme", nvme_path="/x", zero_stage=3)
    est = off.estimate_states(1001, plan=plan, world_size=world, param_bytes=2)
    assert est.total(place="nvme") == 251 * 2 + 251 * 12
    assert est.total(place="device") == 0
    with pytest.raises(ValueError, match="world_size >= 1"):
        off.estimate_states(10, plan=plan, world_size=0)


def test_count_parameters_skips_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].requires_grad_(False)
    assert off.count_parameters(model) == 3 * 4 + 4


def test_nvme_path_missing(tmp_path):
    with pytest.raises(ValueError, match="does not exist: create the folder"):
        off.check_nvme_path(tmp_path / "nope", required_bytes=1)
    assert not (tmp_path / "nope").exists()  # nothing created


def test_nvme_path_not_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        off.check_nvme_path(f, required_bytes=1)


def test_nvme_path_not_writable(tmp_path):
    # /proc refuses new files even for root (os.access would say yes): the probe file is what decides
    with pytest.raises(ValueError, match="is not writable"):
        off.check_nvme_path("/proc", required_bytes=1)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="is not writable"):
            off.check_nvme_path(ro, required_bytes=1)


def test_nvme_path_too_small_refuses_with_numbers(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(ValueError) as err:
        off.check_nvme_path(tmp_path, required_bytes=free, ranks_sharing=2)
    msg = str(err.value)
    assert "free but the offloaded states need about" in msg and "2 rank(s)" in msg
    assert list(tmp_path.iterdir()) == []  # the probe file was removed, nothing half-written


def test_nvme_path_ok(tmp_path):
    assert off.check_nvme_path(tmp_path, required_bytes=MiB) == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_precision_on_cpu():
    off.check_precision("32-true", device_type="cpu")
    off.check_precision("bf16-mixed", device_type="cpu")
    for bad in ("16-mixed", "64-true"):
        with pytest.raises(ValueError, match="not supported by DeepSpeed on CPU"):
            off.check_precision(bad, device_type="cpu")
    off.check_precision("16-mixed", device_type="cuda")


def test_libaio_hint_names_the_package():
    assert "apt-get install -y libaio-dev" in off.LIBAIO_HINT


@needs_deepspeed
def test_config_allows_torch_optimizer_with_offload():
    strategy = OffloadStrategy(optimizer="cpu", parameters="cpu", zero_stage=3)
    zero = strategy.config["zero_optimization"]
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["pin_memory"] is CUDA_AVAILABLE
    plain = OffloadStrategy(optimizer=None, zero_stage=2)
    assert "offload_optimizer" not in plain.config["zero_optimization"]


def test_backend_fsdp2_builds_the_fsdp2_strategy():
    with pytest.raises(ValueError, match="FSDP2OffloadStrategy"):
        OffloadStrategy(backend="fsdp2", optimizer="cpu", parameters="cpu")
    strategy = FSDP2OffloadStrategy(optimizer="cpu", parameters="cpu")
    assert strategy.offload_policy.pin_memory is CUDA_AVAILABLE
    if not CUDA_AVAILABLE:
        with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
            FSDP2OffloadStrategy(pin_memory=True)


@pytest.mark.skipif(not CUDA_AVAILABLE, reason="pinned host memory needs a CUDA device; CPU-only machine")
def test_fsdp2_pinned_memory_on_gpu():
    assert FSDP2OffloadStrategy(pin_memory=True).offload_policy.pin_memory is True


@needs_deepspeed
def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401

    for name in ("offload", "offload_nvme", "offload_fsdp2"):
        assert name in REGISTERED and name in StrategyRegistry
    nvme = StrategyRegistry.get("offload_nvme")
    assert isinstance(nvme, OffloadStrategy) and nvme.plan.parameters == "nvme"
    assert isinstance(StrategyRegistry.get("offload_fsdp2"), FSDP2OffloadStrategy)


def test_report_attribution_and_table():
    plan = off.OffloadPlan(optimizer="nvme", parameters="cpu", nvme_path="/x", zero_stage=3)
    # a CPU device: device and host are the same RAM, the bytes are shown where the plan put them
    row = off.offload_report(
        plan=plan,
        resident={"parameters": {"host": 10}, "gradients": {"host": 20}, "optimizer": {"host": 30}},
        nvme={"optimizer": 400},
        rank=1,
        device_type="cpu",
    )
    assert row["table"]["parameters"] == {"device": 0, "host": 10, "nvme": 0}
    assert row["table"]["gradients"] == {"device": 0, "host": 20, "nvme": 0}
    assert row["table"]["optimizer"] == {"device": 0, "host": 30, "nvme": 400}
    assert row["measured_places"] is False and row["mismatches"] == []
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(off.render_report([row], title="t"))
    text = console.export_text()
    assert "400 B" in text and "optimizer" in text


def test_tensor_bytes_counts_storage_once():
    t = torch.zeros(10)
    assert off.tensor_bytes([t, t[2:], None, torch.empty(0)]) == 40


# ---- memory-lean defaults with parameters on NVMe -------------------------------------------------
@needs_deepspeed
def test_nvme_parameters_lean_defaults(tmp_path):
    from lightning_dist.strategies._offload_nvme import NVME_PARAMS_BUFFER_SIZE

    zero = OffloadStrategy(optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path)).config["zero_optimization"]
    # parameters really on NVMe (DeepSpeed keeps up to `max_in_cpu` elements in host memory), released after each use
    assert zero["offload_param"]["max_in_cpu"] == 0
    assert zero["offload_param"]["buffer_size"] == NVME_PARAMS_BUFFER_SIZE
    assert zero["stage3_max_reuse_distance"] == 0
    # what the user sets is kept
    user = OffloadStrategy(
        optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path), params_buffer_size=123, max_in_cpu=7
    ).config["zero_optimization"]
    assert user["offload_param"]["buffer_size"] == 123 and user["offload_param"]["max_in_cpu"] == 7
    # parameters in host memory or on the device: DeepSpeed's defaults
    for kw in ({"parameters": "cpu"}, {"parameters": None}):
        zero = OffloadStrategy(optimizer="nvme", nvme_path=str(tmp_path), **kw).config["zero_optimization"]
        assert "stage3_max_reuse_distance" not in zero
    # a user config: only the keys it lacks
    config = {
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 1000,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        }
    }
    strategy = OffloadStrategy(optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path), config=config)
    zero = strategy.config["zero_optimization"]
    assert zero["stage3_max_reuse_distance"] == 1000 and zero["offload_param"]["max_in_cpu"] == 0
    assert not strategy._user_buffer_size


@needs_deepspeed
def test_nvme_param_buffers_sized_to_the_largest_partition(tmp_path):
    strategy = OffloadStrategy(optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(100, 300), torch.nn.Linear(300, 7))
    strategy._size_param_buffers(model)  # one process: the partition is the whole parameter
    assert strategy.config["zero_optimization"]["offload_param"]["buffer_size"] == 300 * 100
    kept = OffloadStrategy(optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path), params_buffer_size=5)
    kept._size_param_buffers(model)
    assert kept.config["zero_optimization"]["offload_param"]["buffer_size"] == 5


def test_resize_param_swap_buffers_only_while_free():
    from types import SimpleNamespace

    from lightning_dist._integrations.deepspeed import resize_param_swap_buffers

    freed = []
    handle = SimpleNamespace(
        new_cpu_locked_tensor=lambda n, example: torch.empty(n, dtype=example.dtype),
        free_cpu_locked_tensor=freed.append,
    )

    def swapper(**kw):
        s = SimpleNamespace(
            buffers=torch.empty(5 * 1024),
            available_buffer_ids=[0, 1, 2, 3, 4],
            param_buffer_count=5,
            param_id_to_swap_buffer={},
            inflight_params=[],
            elements_per_buffer=1000,
            aligned_elements_per_buffer=1024,
            aio_read_handle=handle,
            _io_aligned_numel=lambda n: -(-n // 256) * 256,
        )
        return SimpleNamespace(**{**vars(s), **kw})

    free = swapper()
    resize_param_swap_buffers(free, 300)
    assert free.buffers.numel() == 5 * 512 and free.aligned_elements_per_buffer == 512
    assert free.elements_per_buffer == 300
    assert len(freed) == 1
    busy = swapper(available_buffer_ids=[0, 1])  # three partitions in use: their buffers must not move
    resize_param_swap_buffers(busy, 300)
    assert busy.buffers.numel() == 5 * 1024 and len(freed) == 1


@needs_deepspeed
def test_partition_too_large_for_the_swap_buffers_names_the_option(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from lightning.pytorch.strategies import DeepSpeedStrategy

    @contextmanager
    def context(self):
        yield

    monkeypatch.setattr(DeepSpeedStrategy, "model_sharded_context", context)
    strategy = OffloadStrategy(optimizer="nvme", parameters="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ValueError, match="params_buffer_size="):
        with strategy.model_sharded_context():
            raise AssertionError("More elements 20000000 than buffer size 10000000")


def test_training_dtype_follows_the_precision_config():
    from lightning_dist.parallelize.offload import training_dtype

    assert training_dtype({}) == torch.float32
    assert training_dtype({"bf16": {"enabled": True}}) == torch.bfloat16
    assert training_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == torch.float16


def test_one_vocabulary_for_where_state_lives():
    from lightning_dist import measure, planner

    # the offload plan, its report and the planner name the places alike; users' targets map onto them
    assert off.PLACES == planner.TIERS == measure.PLACES == ("device", "host", "nvme")
    plan = off.OffloadPlan(optimizer="nvme", parameters="cpu", zero_stage=3, nvme_path="/tmp")
    assert [plan.place(k) for k in off.KINDS] == ["host", "host", "nvme"]
