"""A tensor-parallel plan checked by running it: the split model's output on one sample equals the unsplit one's.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/probe.py"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dist.parallelize.self_check import first_tensor

# relative output difference allowed for a correct split: rounding of another reduction order, with margin
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _cast(sample: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(sample, Tensor):
        return sample.to(device, dtype) if sample.is_floating_point() else sample.to(device)
    if isinstance(sample, Mapping):
        return {k: _cast(v, device, dtype) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(_cast(v, device, dtype) for v in sample)
    return sample


def _made_up(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(network, sample) guesses for a module without ``example_input_array``, most likely first (may be empty)."""
    children = [c for c in module.children() if any(True for _ in c.parameters())]
    net = children[0] if len(children) == 1 else module
    first = next((m for m in net.modules() if any(True for _ in m.parameters(recurse=False))), None)
    # registration order is not forward order (litgpt registers lm_head before its token embedding): token ids
    # for the first nn.Embedding (images for the first nn.Conv2d) are tried too
    embedding = next((m for m in net.modules() if isinstance(m, (nn.Embedding, nn.Conv2d))), None)
    g = torch.Generator().manual_seed(0)  # the same sample on every rank
    guesses = []
    for layer in dict.fromkeys(m for m in (first, embedding) if m is not None):
        if isinstance(layer, nn.Embedding):
            guesses.append((net, torch.randint(0, layer.num_embeddings, (2, 4), generator=g)))
        elif isinstance(layer, nn.Linear):
            guesses.append((net, torch.randn(2, layer.in_features, generator=g)))
        elif isinstance(layer, nn.Conv2d):  # an image model: square images of the size it declares, if it does
            size = next(
                (getattr(m, "image_size") for m in net.modules() if isinstance(getattr(m, "image_size", None), int)),
                None,
            )
            if size is not None:
                guesses.append((net, torch.randn(2, layer.in_channels, size, size, generator=g)))
    return guesses


class _FlowTrace:
    """Records, during one unsplit forward, the order in which each region's column-/row-wise layers run.

    A region is the parent module of planned layers (as in ``tp_checks.region_problems``); each call of it is
    one sequence. In a split region the data flows replicated -> column-wise (split) -> row-wise (replicated
    again), so within one call a row-wise layer needs a column-wise one before it, and a column-wise layer a
    row-wise one after it. Embeddings (vocab-parallel ``rowwise`` takes token ids) and dict entries stating an
    ``input``/``output`` layout are left out (their author chose the layout).
    """

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
            self.handles.append(
                modules[region].register_forward_pre_hook(
                    lambda m, args, region=region: self.calls.__setitem__(region, self.calls.get(region, 0) + 1)
                )
            )
        for e in planned:
            kind = "row" if e.style == "rowwise" else "col"
            region = e.fqn.rpartition(".")[0]
            self.handles.append(
                modules[e.fqn].register_forward_pre_hook(
                    lambda m, args, region=region, fqn=e.fqn, kind=kind: self.seen.append(
                        (region, self.calls.get(region, 0), fqn, kind)
                    )
                )
            )

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
                key = tuple(self.entries[f].pattern for f in (*rows, "|", *cols, "|", *ran) if f != "|") + (
                    len(rows),
                    len(cols),
                )
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
) -> Optional[tuple[nn.Module, Any, Tensor]]:
    """(what ran, sample, output) of one sample through `module` in eval mode, or None when nothing can run
    (no sample, weights on the meta device, a made-up sample the network does not take, no tensor out).

    `entries`: the resolved plan (on `module`); the forward also traces its regions' layer order and raises
    ``ValueError`` for a row-wise layer fed the replicated input or a column-wise layer whose split output
    leaves its region (see :class:`_FlowTrace`). One process, no collective: the same verdict on every rank.
    """
    params = list(module.parameters())
    if not params or any(p.is_meta for p in params):
        return None
    sample = getattr(module, "example_input_array", None)
    guesses = [(module, sample)] if sample is not None else _made_up(module)
    for net, sample in guesses:
        sample = _cast(sample, device, params[0].dtype)
        trace = _FlowTrace(module, entries or [])
        try:
            out = first_tensor(_run(net, sample))
        except Exception:  # a sample the forward does not take (other inputs or sizes, no forward): the next guess
            continue
        finally:
            trace.close()
        if out is not None:
            problems = trace.problems()
            if problems:
                raise ValueError(
                    "Invalid tensor-parallel plan (found by running one sample through the unsplit"
                    " model):\n  - " + "\n  - ".join(problems)
                )
            return net, sample, out.detach().clone()
    return None


def probe_samples(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(network, sample) guesses to run `module` on, cast to its parameters' device and dtype (meta included):
    ``example_input_array`` or made-up inputs (see the module docstring). Empty when it has no parameters."""
    params = list(module.parameters())
    if not params:
        return []
    sample = getattr(module, "example_input_array", None)
    guesses = [(module, sample)] if sample is not None else _made_up(module)
    return [(net, _cast(s, params[0].device, params[0].dtype)) for net, s in guesses]


def run_eval(module: nn.Module, sample: Any, *, grad: bool = False) -> Any:
    """`module` on `sample` in eval mode (no dropout), eager, with autograd only when `grad`."""
    return _run(module, sample, grad=grad)


def _run(module: nn.Module, sample: Any, grad: bool = False) -> Any:
    training = module.training
    module.eval()
    try:
        # eager even where blocks are compiled: the probe checks the plan, and a compile for its one sample
        # (eval, no grad, its own sizes) would cost a compile and mark the sizes dynamic for training's
        with torch.set_grad_enabled(grad), torch.compiler.set_stance("force_eager"):
            if isinstance(sample, Mapping):
                return module(**sample)
            return module(*sample) if isinstance(sample, tuple) else module(sample)
    finally:
        module.train(training)


def check_probe(module: nn.Module, sample: Any, expected: Tensor, *, describe: str) -> float:
    """Run `sample` through the parallelized `module` (what ran before: the LightningModule or its network)
    and refuse an output that differs from `expected`.

    Collective (the forward and one all-reduce): call on every rank. Returns the relative difference.
    """
    got = first_tensor(_run(module, sample))
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
    if not rel <= tol:
        shape = None if got is None else tuple(got.shape)
        raise ValueError(
            f"{describe}: on one sample (`example_input_array`, or a made-up batch of inputs) the split model's output"
            " differs from the unsplit model's"
            f" (relative difference {rel:.3e} > {tol:.0e}; output shape {shape} vs {tuple(expected.shape)}). A split"
            " layer's forward uses a global size: an attention reading its head count from a shared config, a fused"
            " q/k/v projection that is not head-major ([q | k | v] blocks), a reshape to the full width. Leave that"
            " module out of the plan, or make its forward read sizes from the tensors (view(B, T, -1, head_dim))."
        )
    return rel


__all__ = ["check_probe", "probe_output", "probe_samples", "run_eval"]
