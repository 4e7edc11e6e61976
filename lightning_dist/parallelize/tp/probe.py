"""A tensor-parallel plan checked by running it: the split model's output on one sample equals the unsplit one's.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/probe.py"."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_dist.parallelize.self_check import first_tensor, probe_samples, run_eval

# relative output difference allowed for a correct split: rounding of another reduction order, with margin
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class _LowerPrecision(TorchFunctionMode):
    """Records, during one unsplit forward, the first op whose result depends on the parameters (the activations, not
    a rotary table of positions) and is a floating dtype of lower precision than theirs, and the module that ran it: a
    model that computes parts in float32 (an RMSNorm on `x.float()`) carries float32's rounding, which a split's other
    reduction order or shapes move. Dependence is followed op by op from the parameters (no autograd: the forward
    leaves no graph behind in a module that keeps a tensor of its own)."""

    def __init__(self, owner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps, self.found = torch.finfo(dtype).eps, None  # (dtype, where)
        # tensors computed from the parameters, by id (held until close: one small sample's activations)
        self.derived = {id(p): p for p in owner.parameters()}
        self.where: list[str] = []
        self.handles = []
        for name, m in owner.named_modules():
            label = f"{name or 'the model'} ({type(m).__name__})"
            self.handles.append(m.register_forward_pre_hook(lambda m, a, label=label: self.where.append(label)))
            self.handles.append(m.register_forward_hook(self._left))

    def _left(self, module: nn.Module, args: Any, out: Any) -> None:  # returns None: the output stays as it is
        if self.where:
            self.where.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None and any(id(t) in self.derived for t in tree_leaves((args, kwargs))):
            for t in tree_leaves(out):
                if isinstance(t, Tensor):
                    self.derived[id(t)] = t
                    if t.is_floating_point() and torch.finfo(t.dtype).eps > self.eps:
                        self.found = (t.dtype, self.where[-1] if self.where else "the model")
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.derived.clear()


class _FlowTrace:
    """Records, during one unsplit forward, the order in which each region's column-/row-wise layers run (per call of
    the region): a row-wise layer needs a column-wise one before it, a column-wise layer a row-wise one after it.
    Embeddings (vocab-parallel ``rowwise`` takes token ids) and entries stating their own layout are left out."""

    def __init__(self, owner: nn.Module, entries: list) -> None:
        planned = [
            e
            for e in entries
            if e.active
            and e.style in ("colwise", "colwise_qkv", "rowwise")
            and e.kind in ("linear", "conv1d")
            and not ({"input", "output"} & set(e.options))
        ]
        self.calls: dict[str, int] = {}  # region -> number of times it started
        self.seen: list[tuple[str, int, str, str]] = []  # (region, call, fqn, "col"/"row")
        self.entries = {e.fqn: e for e in planned}
        modules = dict(owner.named_modules())
        self.handles = []
        for region in dict.fromkeys(e.fqn.rpartition(".")[0] for e in planned):
            self.handles.append(modules[region].register_forward_pre_hook(lambda m, args, r=region: self._call(r)))
        for e in planned:
            region, kind = e.fqn.rpartition(".")[0], "row" if e.style == "rowwise" else "col"
            self.handles.append(
                modules[e.fqn].register_forward_pre_hook(lambda m, args, i=(region, e.fqn, kind): self._ran(*i))
            )

    def _call(self, region: str) -> None:
        self.calls[region] = self.calls.get(region, 0) + 1

    def _ran(self, region: str, fqn: str, kind: str) -> None:
        self.seen.append((region, self.calls.get(region, 0), fqn, kind))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def problems(self) -> list[str]:
        by_call: dict[tuple[str, int], list[tuple[str, str]]] = {}
        for region, call, fqn, kind in self.seen:
            by_call.setdefault((region, call), []).append((fqn, kind))
        found: dict[tuple, list[str]] = {}  # the same mistake in every block (one pattern) is reported once
        for (region, _), order in by_call.items():
            kinds = [k for _, k in order]
            first_col = kinds.index("col") if "col" in kinds else len(kinds)
            last_row = len(kinds) - 1 - kinds[::-1].index("row") if "row" in kinds else -1
            rows = tuple(dict.fromkeys(f for i, (f, k) in enumerate(order) if k == "row" and i < first_col))
            cols = tuple(dict.fromkeys(f for i, (f, k) in enumerate(order) if k == "col" and i > last_row))
            if rows or cols:
                ran = list(dict.fromkeys(f for f, _ in order))
                key = (*(self.entries[f].pattern for f in (*rows, *cols, *ran)), len(rows), len(cols))
                found.setdefault(key, [region, rows, cols, ran])
                if region not in found[key]:
                    found[key].append(region)
        out = []
        for region, rows, cols, ran, *also in found.values():
            short = lambda names: [n[len(region) + 1 :] if region else n for n in names]  # noqa: E731
            what = []
            if rows:
                what.append(
                    f"{short(rows)} 'rowwise' run(s) before any column-wise layer of the region, so it is handed"
                    " the region's whole (replicated) input as if it were one shard"
                )
            if cols:
                what.append(
                    f"{short(cols)} 'colwise' run(s) after the region's last row-wise layer, so its split output"
                    " leaves the region"
                )
            styles = {self.entries[f].pattern: "colwise" for f in ran[:-1]}
            styles[self.entries[ran[-1]].pattern] = "rowwise"
            where = (region or "the model root") + (f" (and {len(also)} more like it: {also[:2]})" if also else "")
            out.append(
                f"{where}: its planned layers run in the order {short(ran)}; "
                + "; ".join(what)
                + " (the split forward would fail with torch's 'a and b must have same reduction dim' or 'mat1 and mat2"
                " shapes cannot be multiplied'). In a split region the layers that read its input are 'colwise' and the"
                f" one that writes its output is 'rowwise': here {styles}."
            )
        return out


def probe_output(
    module: nn.Module, device: torch.device, entries: Optional[list] = None
) -> Optional[tuple[nn.Module, Any, Tensor, Optional[tuple[torch.dtype, str]]]]:
    """(what ran, sample, output, inner) of one sample through `module` in eval mode, or None when nothing can run
    (no sample, weights on the meta device, a made-up sample the network does not take, no tensor out). `inner`:
    (dtype, module) where the forward first computes activations in a lower precision than its parameters, or None.

    `entries`: the resolved plan (on `module`); the forward also traces its regions' layer order and raises
    ``ValueError`` for a row-wise layer fed the replicated input or a column-wise layer whose split output
    leaves its region (see :class:`_FlowTrace`). One process, no collective: the same verdict on every rank.
    """
    params = list(module.parameters())
    if not params or any(p.is_meta for p in params):
        return None
    for net, sample in probe_samples(module, device):
        trace, lower = _FlowTrace(module, entries or []), _LowerPrecision(module, params[0].dtype)
        try:
            with lower:
                out = first_tensor(run_eval(net, sample))
        except Exception:  # a sample the forward does not take (other inputs or sizes, no forward): the next guess
            continue
        finally:
            trace.close()
            lower.close()
        if out is not None:
            problems = trace.problems()
            if problems:
                raise ValueError(
                    "Invalid tensor-parallel plan (found by running one sample through the unsplit"
                    " model):\n  - " + "\n  - ".join(problems)
                )
            return net, sample, out.detach().clone(), lower.found
    return None


def check_probe(
    module: nn.Module,
    sample: Any,
    expected: Tensor,
    inner: Optional[tuple[torch.dtype, str]] = None,
    *,
    describe: str,
) -> float:
    """Run `sample` through the parallelized `module` (what ran before: the LightningModule or its network)
    and refuse an output that differs from `expected`, beyond the rounding of its dtype or, when the forward computes
    parts in a lower precision (`inner`, from :func:`probe_output`), of that one.

    Collective (the forward and one all-reduce): call on every rank. Returns the relative difference.
    """
    try:
        got = first_tensor(run_eval(module, sample))
    except ValueError:
        raise
    except Exception as err:  # the unsplit model took this sample: the split one fails on it
        raise split_failure(describe, err) from err
    full = getattr(got, "full_tensor", None)
    got = full() if callable(full) else got
    if got is None or got.shape != expected.shape:
        rel = float("inf")
    else:
        rel = ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([rel], dtype=torch.float64, device=expected.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # one verdict on every rank
        rel = float(t.item())
    tol = _TOLERANCE.get(expected.dtype, 1e-4)
    why = ""
    if inner is not None and _TOLERANCE.get(inner[0], 1e-4) > tol:  # that dtype's rounding, moved by the split
        tol = _TOLERANCE.get(inner[0], 1e-4)
        why = f", {str(inner[0]).replace('torch.', '')}'s as the model computes in it ({inner[1]} first)"
    if not rel <= tol:
        shape = None if got is None else tuple(got.shape)
        raise ValueError(
            f"{describe}: on one sample (`example_input_array`, or a made-up batch of inputs) the split model's output"
            " differs from the unsplit model's"
            f" (relative difference {rel:.3e} > {tol:.0e}{why}; output shape {shape} vs {tuple(expected.shape)})."
            " A split"
            " layer's forward uses a global size: an attention reading its head count from a shared config, a fused"
            " q/k/v projection that is not head-major ([q | k | v] blocks), a reshape to the full width. Leave that"
            " module out of the plan, or make its forward read sizes from the tensors (view(B, T, -1, head_dim))."
        )
    return rel


def split_failure(describe: str, err: BaseException) -> ValueError:
    """The refusal of a split model that fails where the unsplit one runs (alike on every rank: same code and sizes)."""
    what = (str(err).strip().splitlines() or [""])[0][:300]
    return ValueError(
        f"{describe}: the split model fails on a probe sample the unsplit model takes ({type(err).__name__}: {what})."
        " Its forward uses something the split does not cover: a tensor built outside a split region for every head"
        " (an ALiBi bias, a per-head mask), or an in-place change of a split layer's output (`out += residual`). Leave"
        " that region out of the plan, or train this model without tensor parallelism."
    )


__all__ = ["check_probe", "probe_output", "split_failure"]
