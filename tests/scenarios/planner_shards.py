"""Live shard sizes of FSDP2 / HSDP / ZeroRedundancyOptimizer vs the planner's exact counts (torchrun, gloo).

Run with 4 processes. Prints one ``RESULT {json}`` per rank:
``fsdp``/``hsdp``: parameters whose local numel differs from ``fsdp2_local_numel`` (expect none) and the
live vs planned model-state bytes after one Adam step; ``zero1``: optimizer-state elements this rank owns
vs ``zero_redundancy_partition``.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from lightning_dist._compat import fully_shard_api
from lightning_dist._integrations.torch_distributed import destroy_process_groups_for_exit
from lightning_dist.planner import (
    data_parallel_traffic,
    fsdp2_local_numel,
    fsdp2_state_bytes,
    fsdp2_traffic,
    state_bytes,
    zero_redundancy_partition,
)


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)  # odd sizes: uneven dim-0 chunks, some ranks hold nothing of the bias
        self.scale = nn.Parameter(torch.ones(1, d_out))  # one row: only rank 0 holds it

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 5)
        self.blocks = nn.ModuleList([Block(5, 7), Block(7, 3), Block(3, 9)])
        self.head = nn.Linear(9, 2)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def live_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the local parameter shards, gradients and optimizer moments (Adam's scalar `step` apart)."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = steps = 0
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                nbytes = _local(value).numel() * value.element_size()
                if key == "step":
                    steps += nbytes
                else:
                    moments += nbytes
    return {"params": params, "grads": grads, "optimizer": moments, "step_scalars": steps}


class CollectiveRecorder:
    """Records the c10d collectives FSDP2 issues (op, group size, bytes), calling through to the real ones.

    FSDP2 looks ``all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` up on ``torch.distributed``
    at call time; the recorder wraps those attributes for the duration of a ``with`` block.
    """

    # attribute -> (op, keyword of the full-size tensor, its position)
    _OPS = {
        "all_gather_single": ("all_gather", "output_tensor", 0),
        "reduce_scatter_single": ("reduce_scatter", "input", 1),
        "all_reduce": ("all_reduce", "tensor", 0),
    }

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self._saved: dict = {}

    def __enter__(self):
        for attr, (op, kw, pos) in self._OPS.items():
            real = self._saved[attr] = getattr(dist, attr)

            def wrapper(*args, _real=real, _op=op, _kw=kw, _pos=pos, **kwargs):
                tensor = kwargs[_kw] if _kw in kwargs else args[_pos]
                nbytes = tensor.numel() * tensor.element_size()
                self.calls.append((_op, dist.get_world_size(kwargs.get("group")), nbytes))
                return _real(*args, **kwargs)

            setattr(dist, attr, wrapper)
        return self

    def __exit__(self, *exc):
        for attr, real in self._saved.items():
            setattr(dist, attr, real)

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op, group, nbytes in self.calls:
            out[f"{op}/{group}"] = out.get(f"{op}/{group}", 0) + nbytes
        return out


def sharded_case(mesh, shard_size: int, shard_rank: int) -> dict:
    fully_shard, *_ = fully_shard_api()
    torch.manual_seed(0)
    model = Net()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mismatches = []
    for name, p in model.named_parameters():
        want = fsdp2_local_numel(shapes[name], shard_size, shard_rank)
        if _local(p).numel() != want:
            mismatches.append([name, list(shapes[name]), _local(p).numel(), want])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model(torch.randint(0, 6, (4,))).backward()
    opt.step()
    # one more forward + backward with the collectives recorded
    with CollectiveRecorder() as rec:
        model(torch.randint(0, 6, (4,))).backward()
    unit_ids = {id(p) for b in model.blocks for p in b.parameters()}
    state = state_bytes(precision="32-true", optimizer="adam")
    replicate = mesh.size() // shard_size
    traffic = fsdp2_traffic(
        [shapes[n] for n, p in model.named_parameters() if id(p) in unit_ids],
        root_shapes=[shapes[n] for n, p in model.named_parameters() if id(p) not in unit_ids],
        shard_size=shard_size,
        replicate_size=replicate,
        state=state,
    )
    closed = data_parallel_traffic(
        sum(math.prod(s) for s in shapes.values()),
        state=state,
        zero_stage=3,
        shard_size=shard_size,
        replicate_size=replicate,
    )
    group = {"all_gather": shard_size, "reduce_scatter": shard_size, "all_reduce": replicate}
    planned_traffic = {f"{c.op}/{group[c.op]}": c.payload_bytes for c in traffic}
    closed_traffic = {f"{c.op}/{group[c.op]}": c.payload_bytes for c in closed}
    planned = fsdp2_state_bytes(shapes.values(), shard_size=shard_size, rank=shard_rank, state=state)
    with_steps = fsdp2_state_bytes(shapes.values(), shard_size=shard_size, rank=shard_rank, state=state, step_bytes=4)
    return {
        "mismatches": mismatches,
        "live": live_state_bytes(model, opt),
        "planned": {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer},
        "planned_optimizer_with_steps": with_steps.optimizer,
        "traffic": rec.totals(),
        "planned_traffic": planned_traffic,
        "closed_form_traffic": closed_traffic,
    }


def zero1_case(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    numels = [p.numel() for p in model.parameters()]
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    model(torch.randint(0, 6, (4,))).backward()
    opt.step()
    owned = sum(v.numel() for s in opt.optim.state.values() for k, v in s.items() if k == "exp_avg")
    live = live_state_bytes(model, opt.optim)
    planned = fsdp2_state_bytes(
        [tuple(p.shape) for p in model.parameters()],
        shard_size=world,
        rank=rank,
        state=state_bytes(precision="32-true", optimizer="adam"),
        zero_stage=1,
        step_bytes=4,
    )
    return {
        "owned": owned,
        "planned": zero_redundancy_partition(numels, world)[rank],
        "live_bytes": live,
        "planned_bytes": {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer},
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with 4 processes"
    fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out = {
        "rank": rank,
        "fsdp": sharded_case(fsdp_mesh, world, rank),
        "hsdp": sharded_case(hsdp_mesh, 2, hsdp_mesh.get_local_rank("dp_shard")),
        "zero1": zero1_case(rank, world),
    }
    print("RESULT " + json.dumps(out), flush=True)
    destroy_process_groups_for_exit()  # flushes gloo's workers first: no abort at exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
