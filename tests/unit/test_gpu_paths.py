"""Issue 15 (GPU fidelity), the parts that run in one CPU process: offload at world size 1, measured
reports, DeepSpeedCPUAdam, the SyncBatchNorm kernel dispatch. GPU-only checks skip with the reason."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist._compat import CUDA_AVAILABLE

needs_cuda = pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device (GPU-only check)")


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
        return DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)),
                          batch_size=4)


def _fit(strategy, module: pl.LightningModule, **kw) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="64-true", **kw)
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

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(8, 4, 5, 5, device="cuda", dtype=torch.float64, generator=g) * 3 + 1
        w = torch.rand(4, device="cuda", dtype=torch.float64, generator=g)
        b = torch.rand(4, device="cuda", dtype=torch.float64, generator=g)
        dy = torch.randn_like(x)
        outs = []
        for fn in (torch_sync_batchnorm_function(), _SyncBatchNormFn):
            xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
            rm, rv = torch.zeros(4, device="cuda", dtype=torch.float64), torch.ones(4, device="cuda",
                                                                                     dtype=torch.float64)
            y = fn.apply(xi, wi, bi, rm, rv, 1e-5, 0.1, dist.group.WORLD, 1)
            y.backward(dy)
            outs.append((y.detach(), xi.grad, wi.grad, bi.grad, rm, rv))
        for a, c in zip(*outs):
            assert ((a - c).abs().max() / c.abs().max()).item() <= 1e-12
    finally:
        if started:
            dist.destroy_process_group()
