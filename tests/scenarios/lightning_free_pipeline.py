"""A 2-stage 1F1B pipeline step (float64, 4 micro-batches) from ``lightning_dist.parallelize`` alone, with Lightning
unimportable: the split, ``pipeline_model`` and ``PipelineRunner``, held to one device on the whole batch."""

import importlib.abc
import json
import os
import sys

_BLOCKED = ("lightning", "pytorch_lightning", "lightning_fabric")


class _NoLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name.split(".")[0])
        return None


sys.meta_path.insert(0, _NoLightning())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import lightning_dist  # noqa: E402
from lightning_dist.mesh import PP, DistMesh, MeshSpec  # noqa: E402
from lightning_dist.parallelize import ParallelizeConfig, pipeline_model  # noqa: E402
from lightning_dist.parallelize.pipeline.schedule import PipelineRunner  # noqa: E402
from lightning_dist.parallelize.pipeline.split import plan_split  # noqa: E402
from lightning_dist.rules import stage_ranks  # noqa: E402


def emit(**payload) -> None:  # tests/scenarios/_common.py's, which imports Lightning
    os.write(1, ("RESULT " + json.dumps(payload) + "\n").encode())


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net().double()
    reference = Net().double()
    reference.load_state_dict(net.state_dict())
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss

    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()

    mesh = DistMesh.build(MeshSpec(world_size=world, devices_per_node=world, pp=2, dp_replicate=1, dp_shard=1), "cpu")
    split = plan_split(net, 2)
    ranks = stage_ranks(2, 2)
    local = [s for s, r in enumerate(ranks) if r == mesh.local_rank(PP)]
    container, views = pipeline_model(net, mesh, ParallelizeConfig(), split=split, stage_indices=local)
    runner = PipelineRunner(views, local, ranks, schedule="1f1b", device=torch.device("cpu"), group=mesh.group(PP))
    _, loss, _ = runner.step(x, n_microbatches=4, loss_fn=loss_fn, target=y, keep_output=False)

    ref_grads = dict(reference.named_parameters())
    held = list(container.named_parameters())
    worst = max(((p.grad - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item() for n, p in held)
    try:
        lightning_dist.HybridShardStrategy  # noqa: B018
        refusal = None
    except ImportError as err:
        refusal = str(err)
    emit(
        rank=rank,
        params=len(held),
        grad_rel=worst,
        loss_rel=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        leaked=sorted(m for m in sys.modules if m.split(".")[0] in _BLOCKED),
        refusal=refusal,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
