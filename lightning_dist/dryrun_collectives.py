"""The dry run's record of collectives: op, mesh dim and payload bytes of each call on the fake process group."""

from __future__ import annotations

from typing import Any

from lightning_dist.mesh import DP, DP_REPLICATE, DP_SHARD, PP, TP, MeshSpec


class CollectiveRecorder:
    """A ``TorchDispatchMode`` that records each collective's op, mesh dim and payload bytes.

    torch's ``CommDebugMode`` counts calls per op but not bytes nor groups, so the few lines here read
    both from the op's arguments. Payloads follow :class:`~lightning_dist.planner.Collective`: all-gather
    the gathered output, reduce-scatter the full input, all-reduce / broadcast the tensor, send the tensor.
    """

    def __init__(self, spec: MeshSpec, rank: int) -> None:
        import torch

        self.rank = rank
        # a group's ranks -> the mesh dim whose group holds them (dims of size 1 have no collectives)
        self.dims: dict[frozenset, str] = {}
        for name in (TP, DP_SHARD, DP_REPLICATE, PP, DP):
            self.dims.setdefault(frozenset(spec.group_ranks(rank, name)), name)
        self.records: dict[tuple[str, str], dict[str, float]] = {}
        c10d, fn = torch.ops.c10d, torch.ops._c10d_functional
        # op -> (planner op name, how to get (payload tensor, is the payload the tensor times the group size))
        self._ops = {
            c10d._allgather_base_.default: ("all_gather", 0),
            c10d.allgather_.default: ("all_gather", 0),
            c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
            c10d.reduce_scatter_.default: ("reduce_scatter", 1),
            c10d.allreduce_.default: ("all_reduce", 0),
            c10d.broadcast_.default: ("broadcast", 0),
            c10d.send.default: ("send_recv", 0),
            fn.all_reduce.default: ("all_reduce", 0),
            fn.all_reduce_.default: ("all_reduce", 0),
            fn.all_gather_into_tensor.default: ("all_gather", 0),
            fn.reduce_scatter_tensor.default: ("reduce_scatter", 0),
            fn.broadcast.default: ("broadcast", 0),
        }
        self._functional = {
            fn.all_reduce.default,
            fn.all_reduce_.default,
            fn.all_gather_into_tensor.default,
            fn.reduce_scatter_tensor.default,
            fn.broadcast.default,
        }
        self._mode = None

    def _group_ranks(self, func: Any, args: tuple) -> frozenset:
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        if func in self._functional:
            name = [a for a in args if isinstance(a, str)][-1]  # the group name comes last
            return frozenset(dist.get_process_group_ranks(_resolve_process_group(name)))
        from torch._C._distributed_c10d import ProcessGroup

        boxed = next(a for a in args if isinstance(a, torch.ScriptObject))  # c10d ops take the group boxed
        return frozenset(dist.get_process_group_ranks(ProcessGroup.unbox(boxed)))

    def _record(self, func: Any, args: tuple, out: Any) -> None:
        import torch

        op, _ = self._ops[func]
        ranks = self._group_ranks(func, args)
        dim = self.dims.get(ranks, f"group{sorted(ranks)[:4]}")
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        nested = [
            t
            for a in args
            if isinstance(a, (list, tuple))
            for x in a
            for t in (x if isinstance(x, (list, tuple)) else [x])
            if isinstance(t, torch.Tensor)
        ]
        size = len(ranks)
        if func in self._functional:
            inp = tensors[0]
            payload = inp.numel() * inp.element_size() * (size if op == "all_gather" else 1)
        elif op == "all_gather":  # (output, input): the gathered output
            first = args[0]
            outs = first if isinstance(first, (list, tuple)) else [first]
            flat = [t for x in outs for t in (x if isinstance(x, (list, tuple)) else [x])]
            payload = sum(t.numel() * t.element_size() for t in flat)
        elif op == "reduce_scatter":  # (output, input): the full input
            second = args[1]
            ins = second if isinstance(second, (list, tuple)) else [second]
            flat = [t for x in ins for t in (x if isinstance(x, (list, tuple)) else [x])]
            payload = sum(t.numel() * t.element_size() for t in flat)
        else:
            payload = sum(t.numel() * t.element_size() for t in (nested or tensors))
        entry = self.records.setdefault((op, dim), {"payload_bytes": 0.0, "calls": 0, "group_size": size})
        entry["payload_bytes"] += payload
        entry["calls"] += 1

    def __enter__(self) -> "CollectiveRecorder":
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func in recorder._ops:
                    recorder._record(func, args, out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)

    def rows(self) -> list[dict[str, Any]]:
        return [{"op": op, "dim": dim, **v} for (op, dim), v in sorted(self.records.items())]
