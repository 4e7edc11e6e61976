"""The self-checks of a split model: one forward and backward on a probe sample, each split block (or, under ep, each
experts module) held to an unsplit copy, outputs and the gradients the optimizer will use (``docs/self_checks.md``)."""

from __future__ import annotations

import copy
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_dist.parallelize.clone import full_tensor_of, unsharded_clone
from lightning_dist.parallelize.ep import GLOBAL_EXPERTS_KEY, dropless

# relative difference a correct split stays under (rounding of another reduction order, with a wide margin); a
# missing or doubled reduction is off by tens of percent
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.15}
R = TypeVar("R")


@dataclass
class SelfCheckReport:
    """What the check measured (the same on every rank)."""

    blocks: int
    """Blocks compared with an unsplit copy."""
    worst: float
    """Largest relative difference found (outputs and gradients), over every rank."""
    where: str
    """The block output or parameter it was found on."""
    seconds: float
    """Wall time of the whole check on the slowest rank."""


def first_tensor(out: Any) -> Optional[Tensor]:
    """The tensor of a module's output that training uses: itself, HF's ``logits``, else the first tensor of a tuple,
    list or mapping (None when there is none). The one reading of outputs of the pack's probes and self-checks."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)  # HuggingFace ModelOutput
    if isinstance(logits, Tensor):
        return logits
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (list, tuple)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


# ---- probe samples -------------------------------------------------------------------------------
def _cast(sample: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """`sample` with its tensors on `device`, floating ones in `dtype`; anything else as it is."""

    def one(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x.to(device, dtype) if x.is_floating_point() else x.to(device)
        if isinstance(x, Mapping):  # a mapping pytree does not walk (HF's BatchEncoding): as a dict, walked
            return _cast(dict(x), device, dtype)
        return x

    return tree_map(one, sample)


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


def probe_samples(module: nn.Module, device: Optional[torch.device] = None) -> list[tuple[nn.Module, Any]]:
    """(network, sample) guesses to run `module` on: its ``example_input_array``, else made-up token ids, rows or
    images for the network it holds; cast to `device` (default: its parameters') and its parameters' dtype. Empty when
    it has no parameters."""
    params = list(module.parameters())
    if not params:
        return []
    sample = getattr(module, "example_input_array", None)
    guesses = [(module, sample)] if sample is not None else _made_up(module)
    return [(net, _cast(s, device or params[0].device, params[0].dtype)) for net, s in guesses]


def run_eval(module: nn.Module, sample: Any, *, grad: bool = False) -> Any:
    """`module` on `sample` in eval mode (no dropout), eager, with autograd only when `grad`."""
    training = module.training
    module.eval()
    try:
        # eager even where blocks are compiled: a compile for the probe's one sample (eval, its own sizes) would cost
        # a compile and mark the sizes dynamic for training's
        with torch.set_grad_enabled(grad), torch.compiler.set_stance("force_eager"):
            if isinstance(sample, Mapping):
                return module(**sample)
            return module(*sample) if isinstance(sample, tuple) else module(sample)
    finally:
        module.train(training)


def run_first_probe(
    module: nn.Module, check: Callable[[Callable[[], Any]], R], *, roll: int = 0, errors: Optional[list] = None
) -> Optional[R]:
    """``check(run)``, `run` being `module`'s forward (eval mode, autograd on) on the first probe sample it takes, that
    sample rolled by `roll` along its last dim (a sample of its own per data-parallel rank). The check's refusal (a
    ``ValueError``) propagates; any other error tries the next sample, alike on every rank (appended to `errors`).
    None when no sample runs."""
    for net, sample in probe_samples(module):
        if roll:
            sample = tree_map(lambda t: t.roll(roll, -1) if isinstance(t, Tensor) and t.dim() else t, sample)
        try:
            return check(lambda: run_eval(net, sample, grad=True))
        except ValueError:
            raise
        except Exception as err:  # a made-up sample this forward does not take: the next guess
            if errors is not None:
                errors.append(err)
            continue
    return None


class SplitRunError(RuntimeError):
    """The split model's own forward failed on a probe sample (its cause: the error), not the check's copies."""


def split_run(run: Callable[[], Any]) -> Callable[[], Any]:
    """`run`, its errors other than a refusal raised as :class:`SplitRunError` (to tell them from the copies')."""

    def wrapped() -> Any:
        try:
            return run()
        except ValueError:
            raise
        except Exception as err:
            raise SplitRunError(str(err)) from err

    return wrapped


# a gradient is compared relative to its own size, or to this share of its block's when smaller: a parameter whose exact
# gradient is zero (a key bias: softmax ignores a shift) holds rounding noise only, which is no split error
FLOOR = 1e-3


def _rel(got: Optional[Tensor], ref: Optional[Tensor], floor: float = 0.0) -> float:
    if got is None and ref is None:
        return 0.0
    if got is None or ref is None or got.shape != ref.shape:
        return float("inf")
    ref64 = ref.detach().double()
    return ((got.detach().double() - ref64).norm() / max(ref64.norm().item(), floor, 1e-30)).item()


def _norm(grads: Any) -> float:
    return float(sum(g.detach().double().norm() ** 2 for g in grads if g is not None) ** 0.5)


def _detached(value: Any) -> Any:
    """A copy of captured inputs that later ops cannot change: tensors detached and cloned, other values deep-copied
    where they can be (a key/value cache holding graded tensors cannot: it is dropped, the copy recomputes its keys)."""

    def one(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x.detach().clone()
        try:
            return copy.deepcopy(x)
        except Exception:
            return None

    return tree_map(one, value)


def _seeded_like(t: Tensor, seed: int) -> Tensor:
    """A random tensor shaped like `t`'s whole value, the same on every rank (laid out as `t` when a DTensor)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(tuple(t.shape), generator=g, dtype=torch.float64).to(t.device, t.dtype)
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None)
    return whole


class _Capture:
    """Each block's inputs as it received them, its output as it returned it, and the gradient that output got."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        self.inputs: dict[str, tuple] = {}
        self.outputs: dict[str, Tensor] = {}
        self.grads: dict[str, Tensor] = {}
        self.handles = []
        for name, block in blocks:
            # first among the pre-hooks: the inputs before any style's layout hook changes them
            self.handles.append(block.register_forward_pre_hook(self._pre(name), prepend=True, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in self.inputs:  # a block called twice (shared): its first call
                self.inputs[name] = _detached((args, kwargs))

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            t = first_tensor(out)
            if t is None or name in self.outputs:
                return
            self.outputs[name] = t.detach().clone()
            if t.requires_grad:
                t.register_hook(lambda g: self.grads.setdefault(name, g.detach().clone()))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _compare_block(name: str, block: nn.Module, cap: _Capture) -> tuple[float, str]:
    """(worst relative difference, where) of one block against its unsplit copy. Collective (gathers weights)."""
    split_grads = {n: None if p.grad is None else full_tensor_of(p.grad) for n, p in block.named_parameters()}
    ref = unsharded_clone(block, {}, {}).eval()  # as the split forward ran (run_eval): no dropout, no sampling
    # experts split over ep ranks (tp x ep): whole copies, run on this rank's tokens; their gradients hold every ep
    # rank's tokens, which check_experts compares (run before this check)
    experts = [n for n, m in block.named_modules() if n and GLOBAL_EXPERTS_KEY in m.__dict__]
    for n in experts:  # their weights are gathered in the copy already: the module's own forward in place of dispatch
        _whole_experts(block.get_submodule(n), ref.get_submodule(n))
    args, kwargs = tree_map(lambda x: full_tensor_of(x) if isinstance(x, Tensor) else x, cap.inputs[name])
    with torch.enable_grad(), torch.compiler.set_stance("force_eager"):
        out = first_tensor(ref(*args, **kwargs))
        grad = cap.grads.get(name)
        if out is not None and grad is not None and out.requires_grad:
            out.backward(full_tensor_of(grad).to(out.dtype))
    worst, where = _rel(full_tensor_of(cap.outputs[name]), out), f"{name} (its output)"
    floor = FLOOR * _norm(p.grad for p in ref.parameters())
    for n, p in ref.named_parameters():
        if not p.requires_grad or any(n.startswith(f"{e}.") for e in experts):
            continue
        d = _rel(split_grads.get(n), p.grad if p.grad is not None else torch.zeros_like(p), floor)
        if split_grads.get(n) is None and p.grad is None:
            d = 0.0
        if d > worst:
            worst, where = d, f"{name}.{n} (its gradient)"
    return worst, where


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _replicas_disagree(model: nn.Module, group: Any) -> tuple[float, str]:
    """(worst relative spread, parameter) of the gradients of parameters held whole on every rank of `group`: one
    all-gather of all of them (norms and biases: small)."""
    from torch.distributed.tensor import DTensor, Replicate

    names, chunks = [], []
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(not isinstance(pl, Replicate) for pl in g.placements):
                continue  # split: each rank holds its own part
            g = g.to_local()
        names.append(n)
        chunks.append(g.detach().double().flatten())
    if not chunks:
        return 0.0, ""
    flat = torch.cat(chunks)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    sizes = [c.numel() for c in chunks]
    pieces = [g.split(sizes) for g in gathered]
    floor = FLOOR * _norm(_local(p.grad) for p in model.parameters() if p.grad is not None)
    worst, where = 0.0, ""
    for i, n in enumerate(names):
        d = max(_rel(other[i], pieces[0][i], floor) for other in pieces[1:])
        if d > worst:
            worst, where = d, f"{n} (its gradient differs between the ranks that hold it whole)"
    return worst, where


def _verdict(worst: float, where: str, start: float) -> tuple[float, str, float]:
    """One verdict on every rank: the worst difference anywhere, where it was, and the slowest rank's seconds since
    `start` (one object all-gather)."""
    seconds = time.perf_counter() - start
    if dist.is_available() and dist.is_initialized():
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (worst, where, seconds))
        worst, where, _ = max(rows, key=lambda r: r[0])
        seconds = max(r[2] for r in rows)
    return worst, where, seconds


def check_split_model(
    model: nn.Module,
    run: Callable[[], Any],
    blocks: Sequence[tuple[str, nn.Module]],
    *,
    replica_group: Any = None,
    describe: str,
) -> SelfCheckReport:
    """Run `run()` (the split model's forward on a probe sample, eval mode) and a backward of a seeded projection of its
    output, then compare each of `blocks` with an unsplit copy and the whole-held parameters' gradients over
    `replica_group` (e.g. the tp group). Raises ``ValueError`` on every rank naming the worst block or parameter.

    Collective: call on every rank of the model's mesh, with the same sample. Leaves no gradient behind.
    """
    start = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype if params else torch.float32
    cap = _Capture(blocks)
    try:  # experts split over ep ranks drop nothing, as their whole copies
        with torch.enable_grad(), torch.compiler.set_stance("force_eager"), dropless(model.modules()):
            out = first_tensor(run())
            if out is None or not out.requires_grad:
                return SelfCheckReport(0, 0.0, "no graded output", time.perf_counter() - start)
            (out * _seeded_like(out, 1234)).sum().backward()
    finally:
        cap.close()
    try:
        worst, where = 0.0, ""
        for name, block in blocks:
            if name in cap.inputs and name in cap.outputs:
                d, w = _compare_block(name, block, cap)
                if d > worst:
                    worst, where = d, w
        if replica_group is not None and dist.get_world_size(replica_group) > 1:
            d, w = _replicas_disagree(model, replica_group)
            if d > worst:
                worst, where = d, w
    finally:
        for p in model.parameters():
            p.grad = None
    worst, where, seconds = _verdict(worst, where, start)
    tol = TOLERANCE.get(dtype, 1e-3)
    if not worst <= tol:
        raise ValueError(
            f"{describe}: the setup self-check ran one forward and backward of the split model and of unsplit copies of"
            f" its blocks on a probe sample, and they differ: relative difference {worst:.3e} > {tol:.0e} in {where}."
            " The split trains a different model than one device would. A parameter held whole on every rank but"
            " computed on each rank's part of a split activation (a per-head norm) needs style 'replicate_grad_sum';"
            " a module whose forward reads a global size needs to be left out of the plan. Fix the plan (or the"
            " model), or pass self_check=False if you have checked this model yourself."
        )
    return SelfCheckReport(len(cap.inputs), worst, where, seconds)


def _whole_experts(module: nn.Module, ref: nn.Module | None = None) -> nn.Module:
    """A plain copy of an experts module under ep: every expert's weights gathered, its own class's forward. `ref`:
    its plain copy already made (inside a copied block), given the module's own forward in place of the dispatch."""
    original = module.__dict__[GLOBAL_EXPERTS_KEY]["forward"]  # what ran before apply_ep bound its dispatch
    ref = unsharded_clone(module, {}, {}) if ref is None else ref
    ref.__dict__.pop(GLOBAL_EXPERTS_KEY, None)
    ref.__dict__.pop("forward", None)
    if (
        isinstance(original, types.MethodType)
        and original.__self__ is module
        and original.__func__ is not getattr(type(module).forward, "__func__", type(module).forward)
    ):
        ref.forward = types.MethodType(original.__func__, ref)  # a forward of the instance's own, bound to the copy
    return ref


def _mean_over(tensors: list[Tensor], group: Any) -> list[Tensor]:
    """The mean of `tensors` over the ranks of `group` (one all-reduce of them all, in float64)."""
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return tensors
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    return [chunk.view(t.shape).to(t.dtype) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class _Calls:
    """Every call of each experts module: its inputs, its output and the gradient that output got (None: none)."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        self.calls: dict[str, list[list]] = {name: [] for name, _ in modules}
        self.handles = []
        for name, module in modules:
            self.handles.append(module.register_forward_pre_hook(self._pre(name), prepend=True, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[name].append([_detached((args, kwargs)), None, None])

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            call, t = self.calls[name][-1], first_tensor(out)
            if t is None:
                return
            call[1] = t.detach().clone()
            if t.requires_grad:
                t.register_hook(lambda g: call.__setitem__(2, g.detach().clone()))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def check_experts(
    model: nn.Module,
    run: Callable[[], Any],
    experts: Sequence[tuple[str, nn.Module]],
    *,
    dp_group: Any,
    describe: str,
    backward: bool = True,
) -> SelfCheckReport:
    """Run `run()` (the model's forward on this rank's probe sample) and a backward (``backward=False``: `run` runs
    its own, a pipeline's schedule), then hold each experts module to a whole copy of it: its output on this rank's
    tokens in every call, and its experts' gradients (after the dispatch, the ep scaling and FSDP2's reduction: what
    the optimizer steps on) against the copies' gradients from the same output gradients, averaged over `dp_group`
    (the ranks whose gradients data parallelism averages). Raises ``ValueError`` on every rank naming the worst
    parameter.

    Collective: every rank of the mesh calls it, each with its own sample. Leaves no gradient behind.
    """
    start = time.perf_counter()
    cap = _Calls(experts)
    try:
        # dropless: the whole copies drop no token (a capacity factor is the user's declared change, not checked)
        with torch.enable_grad(), torch.compiler.set_stance("force_eager"), dropless(m for _, m in experts):
            out = run()
            graded = not backward
            if backward:
                out = first_tensor(out)
                graded = out is not None and out.requires_grad
                if graded:
                    (out * _seeded_like(out, 4321)).sum().backward()
    finally:
        cap.close()
    worst, where = 0.0, "" if graded else "no graded output"
    try:
        for name, module in experts if graded else ():
            # every rank gathers every module's weights and gradients, in one order, whatever it captured
            split = {n: full_tensor_of(p.grad) if p.grad is not None else None for n, p in module.named_parameters()}
            ref = _whole_experts(module).eval()  # as the split forward ran: no dropout, no sampled routing
            for inputs, got, grad in cap.calls[name]:
                if got is None or grad is None:  # a recomputed forward (checkpointing): no gradient of its own
                    continue
                args, kwargs = tree_map(lambda x: full_tensor_of(x) if isinstance(x, Tensor) else x, inputs)
                with torch.enable_grad():
                    want = first_tensor(ref(*args, **kwargs))
                    want.backward(grad.to(want.dtype))
                d = _rel(got, want)
                if d > worst:
                    worst, where = d, f"{name} (its output)"
            names = [n for n, p in ref.named_parameters() if p.requires_grad]
            mean = _mean_over(
                [
                    ref.get_parameter(n).grad
                    if ref.get_parameter(n).grad is not None
                    else torch.zeros_like(ref.get_parameter(n))
                    for n in names
                ],
                dp_group,
            )
            floor = FLOOR * _norm(mean)
            for n, g in zip(names, mean):
                d = 0.0 if split.get(n) is None and not g.any() else _rel(split.get(n), g, floor)
                if d > worst:
                    worst, where = d, f"{name}.{n} (its gradient)"
    finally:
        for p in model.parameters():
            p.grad = None
    worst, where, seconds = _verdict(worst, where, start)
    params = [p for _, m in experts for p in m.parameters()]
    tol = TOLERANCE.get(params[0].dtype if params else torch.float32, 1e-3)
    if not worst <= tol:
        raise ValueError(
            f"{describe}: the setup self-check ran one forward and backward with the experts split over the ep ranks"
            f" and held each experts module to a whole copy of it on the same tokens, and they differ: relative"
            f" difference {worst:.3e} > {tol:.0e} in {where}. Expert parallelism would train a different model than"
            " one device: its dispatch calls the experts' own forward on the rows each rank receives, with routing"
            " weight 1, and weighs the returned rows after; experts whose forward uses the routing weights otherwise"
            " (scales its input by them, say) cannot be split this way. Drop ep for this model, or pass"
            " self_check=False if you have checked it yourself."
        )
    return SelfCheckReport(sum(bool(c) for c in cap.calls.values()), worst, where, seconds)


def gradient_problem(
    params: dict[str, nn.Parameter], whole: Callable[[], Tensor], staged: Callable[[], Tensor]
) -> Optional[str]:
    """Why `staged()` would train differently from `whole()` (None when it would not): the gradients of `params` for
    the same seeded projection of each output differ beyond rounding. One process, no collective; the parameters'
    own gradients are left as they were."""
    graded = {n: p for n, p in params.items() if p.requires_grad}
    kept = {n: p.grad for n, p in graded.items()}
    runs = []
    try:
        for fn in (whole, staged):
            for p in graded.values():
                p.grad = None
            with torch.enable_grad():
                out = fn()
                (out * _seeded_like(out, 4321)).sum().backward()
            runs.append({n: p.grad for n, p in graded.items()})
    finally:
        for n, p in graded.items():
            p.grad = kept[n]
    tol = TOLERANCE.get(next(iter(graded.values())).dtype, 1e-3) if graded else 0.0
    floor = FLOOR * _norm(runs[0].values())
    diffs = {
        n: _rel(runs[1][n], runs[0][n], floor) if runs[0][n] is not None or runs[1][n] is not None else 0.0
        for n in graded
    }
    worst = max(diffs, key=diffs.get, default=None)
    if worst is None or diffs[worst] <= tol:
        return None
    return (
        f"the stages' forward matches but their gradients do not: {worst} differs by {diffs[worst]:.3e} (relative) from"
        " the whole network's on one micro-batch (a tensor detached or recomputed between children, or a parameter the"
        " stages use differently)"
    )


__all__ = [
    "SelfCheckReport",
    "TOLERANCE",
    "check_experts",
    "check_split_model",
    "first_tensor",
    "gradient_problem",
    "probe_samples",
    "run_eval",
    "run_first_probe",
    "split_run",
    "SplitRunError",
]
