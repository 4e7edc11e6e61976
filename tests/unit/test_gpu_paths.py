"""Issue 15 (GPU fidelity), the parts that run in one CPU process: offload at world size 1, measured
reports, DeepSpeedCPUAdam, the SyncBatchNorm kernel dispatch. GPU-only checks skip with the reason."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist._compat import CUDA_AVAILABLE

needs_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device (GPU-only check)")


@pytest.fixture(autouse=True)
def _no_process_group_left(monkeypatch):
    """A one-process fit leaves Lightning's process group up: end it after each test, and let the next fit pick a free
    port (the ended group's store may still hold the one in MASTER_PORT), so later tests start from a clean process."""
    import torch.distributed as dist

    monkeypatch.delenv("MASTER_PORT", raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def _one_rank_nccl_group(tmp_path):
    """A one-rank NCCL default group on GPU 0 for the duration (an existing one is used as it is)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "nccl",
            store=dist.FileStore(str(tmp_path / "store"), 1),
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


class _Net(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)), batch_size=4
        )


def _fit(strategy, module: pl.LightningModule, **kw) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="64-true",
        **kw,
    )
    trainer.fit(module)
    return trainer


# ---- 1. offload at world size 1 ------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:FSDP2 CPU offload saves nothing")
def test_offload_fsdp2_applies_the_policy_with_one_process():
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from lightning_dist.parallelize.fsdp import offload_policies
    from lightning_dist.strategies import FSDP2OffloadStrategy

    module = _Module()
    strategy = FSDP2OffloadStrategy(report=False)
    trainer = _fit(strategy, module)
    assert strategy.mesh.dp_size == 1 and trainer.world_size == 1
    policies = offload_policies(module)
    # every block and the root are FSDP2 units, each with the CPU offload policy in force (not only configured)
    assert set(policies) == {"net", "net.blocks.0", "net.blocks.1"}, policies
    assert all(isinstance(p, CPUOffloadPolicy) for p in policies.values()), policies
    assert isinstance(module.net, FSDPModule)
    for p in module.parameters():  # managed by FSDP2: sharded parameters (one shard), in host memory
        assert isinstance(p, DTensor) and p.to_local().device.type == "cpu"
    states = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.to_local().device.type == "cpu" for t in states)


# ---- 4. SyncBatchNorm: torch's kernels on CUDA -----------------------------------------------------
def test_sync_batchnorm_dispatch_decision():
    from lightning_dist.callbacks.sync_batchnorm import uses_torch_kernels

    # decided from the input's device alone (constructing a device object needs no GPU)
    assert uses_torch_kernels(torch.device("cuda")) and uses_torch_kernels(torch.device("cuda", 3))
    assert uses_torch_kernels("cuda:0")
    assert not uses_torch_kernels(torch.device("cpu")) and not uses_torch_kernels("meta")


@needs_cuda
def test_sync_batchnorm_torch_kernels_match_the_handwritten_path_on_cuda(tmp_path):
    import torch.distributed as dist

    from lightning_dist._compat import torch_sync_batchnorm_function
    from lightning_dist.callbacks.sync_batchnorm import _SyncBatchNormFn

    with _one_rank_nccl_group(tmp_path):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(8, 4, 5, 5, device="cuda", dtype=torch.float64, generator=g) * 3 + 1
        w = torch.rand(4, device="cuda", dtype=torch.float64, generator=g)
        b = torch.rand(4, device="cuda", dtype=torch.float64, generator=g)
        dy = torch.randn_like(x)
        outs = []
        for fn in (torch_sync_batchnorm_function(), _SyncBatchNormFn):
            xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
            rm, rv = (
                torch.zeros(4, device="cuda", dtype=torch.float64),
                torch.ones(4, device="cuda", dtype=torch.float64),
            )
            y = fn.apply(xi, wi, bi, rm, rv, 1e-5, 0.1, dist.group.WORLD, 1)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, wi.grad, bi.grad, rm, rv))
        for a, c in zip(*outs):
            assert ((a - c).abs().max() / c.abs().max()).item() <= 1e-12


# ---- 3. DeepSpeedCPUAdam for the offloaded step ----------------------------------------------------
def test_cpu_adam_decision_and_hyper_parameters():
    from lightning_dist.parallelize import offload as off

    params = [nn.Parameter(torch.zeros(3))]
    opts, _ = off.cpu_adam_options(torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1))
    assert opts == {
        "lr": 0.01,
        "betas": (0.8, 0.9),
        "eps": 1e-6,
        "weight_decay": 0.1,
        "adamw_mode": True,
        "bias_correction": True,
    }
    assert off.cpu_adam_options(torch.optim.Adam(params, weight_decay=0.1))[0]["adamw_mode"] is False  # L2
    for other, why in (
        (torch.optim.SGD(params, lr=0.1), "not torch.optim.Adam/AdamW"),
        (torch.optim.AdamW(params, amsgrad=True), "amsgrad"),
        (torch.optim.Adam(params, maximize=True), "maximize"),
    ):
        opts, reason = off.cpu_adam_options(other)
        assert opts is None and why in reason


def test_cpu_adam_only_on_cuda_with_offloaded_optimizer():
    pytest.importorskip("deepspeed")
    from lightning_dist.strategies import OffloadStrategy

    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(3))])
    # on a CPU-only machine (root device cpu) the torch optimizer stays
    strategy = OffloadStrategy()
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy._cpu_step_optimizer(adamw, None) is adamw
    assert OffloadStrategy(cpu_adam=False).cpu_adam is False


def _cpu_adam_or_skip(monkeypatch):
    import os
    import sys

    pytest.importorskip("deepspeed")
    # the Makefile's cache inside the environment (built once, about a minute on 2 cores), also for a bare pytest
    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    )
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([nn.Parameter(torch.zeros(1))])  # builds the op once (cached under TORCH_EXTENSIONS_DIR)
    except Exception as err:  # no compiler, no ninja, unsupported CPU: the parity check cannot run here
        pytest.skip(f"DeepSpeed's cpu_adam op could not be built here: {type(err).__name__}: {err}")


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_cpu_adam_step_matches_torch(cls, monkeypatch):
    _cpu_adam_or_skip(monkeypatch)
    from lightning_dist.parallelize import offload as off

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (33,), (7, 5)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def make():
        ps = [nn.Parameter(t.clone()) for t in init]
        # two groups with their own lr / weight decay: per-group hyper-parameters must carry over
        groups = [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]
        return ps, cls(groups, lr=1e-2, betas=(0.85, 0.98), eps=1e-7)

    ref_params, ref = make()
    ds_params, torch_opt = make()
    scheduler = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    ds = off.to_cpu_adam(torch_opt, scheduler)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    assert type(ds).__name__ == "DeepSpeedCPUAdam" and ds.adam_w_mode == (cls is torch.optim.AdamW)
    assert scheduler.optimizer is ds
    for step_grads in grads:  # three steps, the LR halved after each
        for params, opt, sched in ((ref_params, ref, ref_scheduler), (ds_params, ds, scheduler)):
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            opt.step()
            sched.step()
    # float32 op (SIMD, other operation order): agreement to float32 round-off
    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ds_params, ref_params))
    print(f"cpu_adam vs torch {cls.__name__}: max rel diff {diff:.2e}")
    assert diff <= 1e-6, diff
    assert [gr["lr"] for gr in ds.param_groups] == [gr["lr"] for gr in ref.param_groups]
    moved = max(((a - b).abs().max()).item() for a, b in zip(ref_params, init))
    assert moved > 1e-3  # the steps did change the parameters


# ---- 5. torch.compile: options and refusals -------------------------------------------------------
def test_apply_compile_keeps_classes_and_keys():
    from lightning_dist.parallelize import apply_compile

    net = _Net()
    keys = list(net.state_dict())
    assert apply_compile(net) == 2  # the two blocks of the block list, nothing else
    assert [b._compiled_call_impl is not None for b in net.blocks] == [True, True]
    assert net.stem._compiled_call_impl is None
    assert list(net.state_dict()) == keys and type(net.blocks[0]) is nn.Sequential
    assert apply_compile(_Net(), units=["Linear"]) == 4  # by class name
    with pytest.raises(ValueError, match="match no module"):
        apply_compile(_Net(), units=["GPTBlock"])


def test_apply_compile_gives_tensor_parallel_blocks_static_shapes():
    """A block holding DTensor parameters compiles with static shapes: a new input size recompiles with concrete
    sizes (dynamo's automatic dynamic shapes would retrace it with symbolic ones, whose DTensor backward trace
    exceeded the recursion limit); a plain block keeps torch's default and goes dynamic on the second size."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    from lightning_dist.parallelize import apply_compile
    from tests._harness import free_port

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        symbolic: dict[str, list[bool]] = {"tp": [], "plain": []}

        def backend(kind):
            def compile_fn(gm, inputs):  # records whether the graph was traced with symbolic sizes
                symbolic[kind].append(
                    any(
                        isinstance(n.meta.get("example_value"), torch.SymInt)
                        for n in gm.graph.nodes
                        if n.op == "placeholder"
                    )
                )
                return gm.forward

            return compile_fn

        class Block(nn.Module):  # a block class of a user file (dynamo skips torch.nn's own forwards)
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return torch.tanh(self.fc(x))

        for kind in symbolic:
            torch._dynamo.reset()
            net = _Net()
            net.blocks = nn.ModuleList([Block(), Block()])
            if kind == "tp":
                for block in net.blocks:
                    distribute_module(
                        block,
                        mesh,
                        lambda name, m, mesh: [
                            m.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))
                            for n, p in list(m.named_parameters(recurse=False))
                        ],
                    )
            apply_compile(net, backend=backend(kind))
            for rows in (2, 3):
                x = torch.randn(rows, 8)
                net.blocks[0](x if kind == "plain" else distribute_tensor(x, mesh, [Replicate()]))
        assert symbolic == {"tp": [False, False], "plain": [False, True]}, symbolic
    finally:
        torch._dynamo.reset()
        if created:
            dist.destroy_process_group()


def test_tp_blocks_with_plain_input_column_layers_stay_eager():
    """Under a TP plan, a block whose column-wise layers take plain tensors (no region_input: HF's own plans) is left
    eager with a warning naming it; a block with a region input (the transformer plan) and one with no TP are
    compiled."""
    from lightning_dist.parallelize.compile import apply_compile, tp_eager_blocks

    net = _Net(depth=3)
    b0, b1, b2 = net.blocks
    styles = {b0[0]: "colwise", b1: "region_input", b1[0]: "colwise"}
    eager = tp_eager_blocks(net, styles)
    assert list(eager) == [b0] and "plain-tensor inputs (no region_input)" in eager[b0]
    with pytest.warns(UserWarning, match=r"compile=True left 1 of 3 blocks eager \(blocks.0\).*region_input"):
        assert apply_compile(net, eager=eager) == 2
    assert [b._compiled_call_impl is not None for b in net.blocks] == [False, True, True]


def test_compile_reaches_every_built_in_plan():
    from lightning_dist.strategies import (
        FSDP2OffloadStrategy,
        FullyShardStrategy,
        HybridShardStrategy,
        PipelineStrategy,
        TensorParallelStrategy,
    )

    for cls in (HybridShardStrategy, FullyShardStrategy, TensorParallelStrategy, FSDP2OffloadStrategy):
        strategy = cls(compile=["GPTBlock"])
        assert strategy.compile == ["GPTBlock"]
    assert HybridShardStrategy(compile=True).parallelize_config().compile is True
    assert PipelineStrategy(compile=True).compile is True


# ---- 2. measured reports ---------------------------------------------------------------------------
def test_bytes_by_place_reads_tensor_devices():
    from lightning_dist.measure import bytes_by_place

    t = torch.zeros(10)
    assert bytes_by_place([t, t[2:], None, torch.empty(0), torch.empty(4, device="meta")]) == {"device": 0, "host": 40}


def test_offload_report_says_device_for_a_state_planned_offloaded():
    from rich.console import Console

    from lightning_dist.parallelize import offload as off

    plan = off.OffloadPlan(optimizer="cpu", parameters="cpu", zero_stage=3)
    # what the issue measured on one GPU: offload_fsdp2 left every state on the device
    resident = {
        "parameters": {"device": 4000, "host": 0},
        "gradients": {"device": 4000, "host": 0},
        "optimizer": {"device": 8000, "host": 0},
    }
    row = off.offload_report(
        plan=plan, resident=resident, nvme={}, rank=0, device_type="cuda", cuda={"allocated": 2**30, "peak": 3 * 2**30}
    )
    assert row["planned"] == {"parameters": "host", "gradients": "host", "optimizer": "host"}
    assert row["table"]["parameters"] == {"device": 4000, "host": 0, "nvme": 0}  # measured, not planned
    assert [m.split(":")[0] for m in row["mismatches"]] == ["parameters", "gradients", "optimizer"]
    assert "not offloaded" in row["mismatches"][0]
    console = Console(record=True, width=140)
    console.print(off.render_report([row], title="t"))
    text = console.export_text()
    assert "MISMATCH" in text and "peak 3.0 GiB" in text
    # where the plan holds, no mismatch; a state planned on the device found in host memory is one too
    ok = {"parameters": {"device": 0, "host": 4000}, "gradients": {"host": 4000}, "optimizer": {"host": 8000}}
    assert off.offload_report(plan=plan, resident=ok, nvme={}, rank=0, device_type="cuda")["mismatches"] == []
    zero2 = off.OffloadPlan(optimizer="cpu", zero_stage=2)
    bad = off.offload_report(plan=zero2, resident=ok, nvme={}, rank=0, device_type="cuda")["mismatches"]
    assert [m.split(":")[0] for m in bad] == ["parameters"] and "planned on the device" in bad[0]


@pytest.mark.filterwarnings("ignore:FSDP2 CPU offload saves nothing")
def test_memory_report_shows_measured_places_next_to_planned():
    from lightning_dist.callbacks import MemoryReport
    from lightning_dist.callbacks.memory import format_memory
    from lightning_dist.strategies import FSDP2OffloadStrategy

    report = MemoryReport(log=False, print_table=False)
    _fit(FSDP2OffloadStrategy(report=False), _Module(), callbacks=[report])
    row = report.rows[0]
    assert row["planned_places"] == {"params": "host", "grads": "host", "optimizer": "host"}
    # a CPU device: everything is in host memory, which is where the plan put it; nothing to warn about
    assert row["places"]["params"]["host"] > 0 and row["places"]["params"]["device"] == 0
    assert row["mismatches"] == []
    assert "host B" in format_memory(report.rows)


# ---- 6. benchmarks/gpu.py ----------------------------------------------------------------------------
def _load_gpu_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(CUDA_AVAILABLE, reason="checks the message of a machine without CUDA")
def test_gpu_benchmark_exits_with_a_clear_message_without_cuda(capsys):
    gpu = _load_gpu_benchmark()
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--json", "unused.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "torch.cuda.is_available() is False" in err and "benchmarks/offload.py" in err


def test_gpu_benchmark_mfu_arithmetic():
    gpu = _load_gpu_benchmark()
    # the GPT: 163M parameters, 12 layers, width 768, sequence 1024 -> ~1.09 GFLOP per token;
    # 295,602 tokens/s on an H200 (989.4 TFLOP/s bf16) is the MFU 0.326
    fpt = gpu.flops_per_token(163_000_000, layers=12, width=768, seq=1024)
    assert fpt == 6 * 163_000_000 + 12 * 12 * 768 * 1024
    assert abs(295_602 * fpt / gpu.peak_flops("NVIDIA H200", None) - 0.326) < 0.002
    assert gpu.peak_flops("Some GPU", None) is None and gpu.peak_flops("Some GPU", 100) == 1e14
    goals = gpu.goals({"offload_zero2": {"step_ms": 160.0}, "anchor_deepspeed_zero_offload": {"step_ms": 159.4}})
    assert goals["offload_zero2 step / DeepSpeed ZeRO-Offload step <= 1.05"]["met"] is True
    assert goals["hsdp_compile step / compiled plain loop step <= 1.00"] == {"ratio": None, "met": None}


# ---- on a GPU: offload really leaves the device, and the reports say so ---------------------------
@needs_cuda
def test_offload_fsdp2_on_one_gpu_moves_every_state_to_pinned_host_memory():
    from lightning_dist.callbacks import MemoryReport
    from lightning_dist.parallelize.fsdp import offload_policies
    from lightning_dist.strategies import FSDP2OffloadStrategy

    module, report = _Module(), MemoryReport(log=False, print_table=False)
    strategy = FSDP2OffloadStrategy()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cuda",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed",
        callbacks=[report],
    )
    trainer.fit(module)
    assert all(p.pin_memory for p in offload_policies(module).values())
    row = strategy.offload_report()
    assert row["measured_places"] and row["mismatches"] == [], row
    for kind in ("parameters", "optimizer"):
        assert row["table"][kind]["host"] > 0 and row["table"][kind]["device"] == 0, row
    assert report.rows[0]["mismatches"] == [] and report.rows[0]["cuda"] is not None


@needs_cuda
def test_memory_report_warns_when_a_planned_offload_stays_on_the_gpu():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_dist.callbacks import MemoryReport
    from lightning_dist.strategies import HybridShardStrategy

    class Claims(HybridShardStrategy):
        """Says it offloads (the plan) but applies no policy: what offload_fsdp2 did on one GPU before."""

        def parallelize_config(self):
            import dataclasses

            return dataclasses.replace(super().parallelize_config(), offload_policy=None)

    report = MemoryReport(log=False, print_table=False)
    trainer = pl.Trainer(
        strategy=Claims(offload_policy=CPUOffloadPolicy(pin_memory=True)),
        accelerator="cuda",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed",
        callbacks=[report],
    )
    with pytest.warns(UserWarning, match="params: planned in host memory"):
        trainer.fit(_Module())


@needs_cuda
def test_deepspeed_offload_on_one_gpu_runs_cpu_adam_and_reports_host_memory():
    pytest.importorskip("deepspeed")
    from lightning_dist.strategies import OffloadStrategy

    strategy = OffloadStrategy(zero_stage=2)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cuda",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="bf16-mixed",
    )
    trainer.fit(_Module())
    inner = strategy.deepspeed_engine.optimizer.optimizer
    assert type(inner).__name__ == "DeepSpeedCPUAdam" and inner.adam_w_mode  # the user's AdamW, compiled
    row = strategy.offload_report()
    assert row["measured_places"] and row["mismatches"] == [], row
    assert row["table"]["optimizer"]["host"] > 0 and row["table"]["optimizer"]["device"] == 0, row
    assert row["table"]["parameters"]["device"] > 0, row


@needs_cuda
def test_offloaded_activations_on_the_side_stream_give_the_same_gradients_on_cuda():
    from torch import nn

    from lightning_dist.parallelize.ac import apply_offload_activations, offloaded_bytes

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)]).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    net(x).square().sum().backward()
    want = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    x.grad = None
    hooks = apply_offload_activations(net, units=list(net), device_type="cuda")
    assert all(h.stream is not None for h in hooks)  # the copies run on a side stream
    net(x).square().sum().backward()
    torch.cuda.synchronize()
    assert offloaded_bytes(net) > 0
    got = [p.grad for p in net.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_attention_runs_the_cuda_kernels_with_torchs_arguments(tmp_path, dtype):
    # cp_style="ring" on CUDA: flash (bfloat16) or memory-efficient (float32) kernel through torch's ring, forward and
    # backward (the kernels' extra outputs passed to their backward), against SDPA on one GPU (a ring of one rank)
    import torch.distributed as dist

    from lightning_dist._integrations.torch_ring_attention import ring_attention

    with _one_rank_nccl_group(tmp_path):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, generator=g) for _ in "qkv")
        want_in = [t.clone().requires_grad_() for t in (q, k, v)]
        got_in = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*want_in, is_causal=True)
        got = ring_attention(*got_in, group=dist.group.WORLD, is_causal=True)
        dy = torch.randn_like(want)
        want.backward(dy)
        got.backward(dy)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert torch.allclose(got, want, atol=tol, rtol=tol)
        for a, b in zip(got_in, want_in):
            assert torch.allclose(a.grad, b.grad, atol=tol, rtol=tol)
