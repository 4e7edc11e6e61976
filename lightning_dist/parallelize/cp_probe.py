"""Context parallelism checked by running it: one forward and backward of a probe batch, split and unsplit.

Notes: docs/internals.md, "lightning_dist/parallelize/cp_probe.py"."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dist.parallelize.self_check import first_tensor

# relative difference allowed for an exact split: rounding of another reduction order (the exchange, the ring's
# log-sum-exp merges), with margin; measured on exact models (docs/self_checks.md): float64 <= 2.3e-15, float32
# <= 1.2e-6, bf16-mixed <= 9.4e-3, while the silent cases differ by 1e-1 and more
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}
# a parameter's gradient error is measured against at least this share of the whole gradient's norm: a gradient
# that is zero in exact arithmetic (a key bias: softmax is shift-invariant) holds rounding only
_GRAD_FLOOR = 1e-2
_FLOOR_MARGIN = 100  # the split may differ from one device by this many times the model's own rounding
_ROWS = 2  # probe sequences (a pipeline takes one per micro-batch instead)


@dataclass(frozen=True)
class ProbeReport:
    """What the self-check measured (the same on every rank)."""

    output_diff: float
    """Largest relative difference of the split output from the unsplit one's matching tokens, over the ranks."""
    grad_diff: float
    """Largest relative difference of a parameter's gradient (what the optimizer gets) from the unsplit one's."""
    attention_calls: int
    """Attention calls the exchange served in the split pass (forward and recomputation), on the busiest rank."""
    seconds: float
    """Wall time of the check on this rank (both passes and the verdict)."""
    sample: str
    """The probe batch, in words."""
    floor: float = 0.0
    """The unsplit model's difference from itself with its rows reversed (its own rounding: float32 parts inside)."""

    def format(self, describe: str) -> str:
        return (
            f"{describe} self-check: {self.sample} split and unsplit through the model (forward and backward):"
            f" outputs equal to {self.output_diff:.1e}, gradients to {self.grad_diff:.1e} (max relative; the model"
            f" differs from itself by {self.floor:.1e} with its sums reordered), {self.attention_calls} attention"
            f" calls through the exchange; {self.seconds:.2f} s"
            " (self_check=False skips it)."
        )


class CPProbe(Protocol):
    """One strategy's way to run the probe batch through its model (the network's hook, or the pipeline schedule)."""

    inputs: Tensor
    """The probe batch ``[B, S, ...]`` as the network takes it (token ids)."""
    order: int
    """Where this rank's modules run in the whole forward (a pipeline: its first stage's index; else 0)."""

    def run(
        self, *, split: bool, loss: Optional[ProbeLoss], index: Tensor, position_ids: Optional[Tensor] = None
    ) -> Optional[Tensor]:
        """One pass over :attr:`inputs`: split (cp's chunks, the exchange) or whole, then the backward of
        ``loss(output, index's matching chunks)`` (None: forward only, no autograd); ``position_ids`` given to the
        network when not None. Returns the output this rank holds, detached (None: not on this rank)."""
        ...

    def modules(self) -> list[tuple[str, nn.Module]]:
        """This rank's modules, with the names the refusal gives them."""
        ...


def output_tensor(out: Any) -> Optional[Tensor]:
    """The tensor of a network's output that training uses: itself, HF's ``logits``, the first tensor of a tuple or
    mapping; a DTensor (vocabulary-parallel logits) as its whole value (differentiable)."""
    out = first_tensor(out)
    full = getattr(out, "full_tensor", None)
    return full() if callable(full) else out


def probe_inputs(
    network: nn.Module, cp: int, *, example: Any = None, rows: int = _ROWS
) -> Optional[tuple[Tensor, str]]:
    """(probe batch, its description): `rows` sequences of ``4 cp`` tokens (``2 cp`` when the network holds fewer
    positions), from `example` (``example_input_array``: a ``[B, S, ...]`` tensor, cut) or made up (token ids below
    the network's smallest ``nn.Embedding``; floats for a first ``nn.Linear``); None when neither is possible. The
    same on every rank: a fixed generator."""
    limit = _max_positions(network)
    length = next((n for n in (4 * cp, 2 * cp) if limit is None or n <= limit), None)
    if length is None:
        return None
    if isinstance(example, Tensor) and example.dim() >= 2 and example.shape[1] >= 2 * cp:
        length = min(length, example.shape[1] - example.shape[1] % (2 * cp))
        x = example[:rows, :length]
        x = x.repeat(math.ceil(rows / x.shape[0]), *([1] * (x.dim() - 1)))[:rows]
        return x, f"{rows} x {length} tokens of example_input_array"
    g = torch.Generator().manual_seed(0)
    embeddings = [m.num_embeddings for m in network.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        return torch.randint(0, min(embeddings), (rows, length), generator=g), f"{rows} x {length} made-up tokens"
    first = next((m for m in network.modules() if isinstance(m, nn.Linear)), None)
    if first is not None:
        return torch.randn(rows, length, first.in_features, generator=g), f"{rows} x {length} made-up inputs"
    return None


def _max_positions(network: nn.Module) -> Optional[int]:
    config = getattr(network, "config", None)
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "block_size", None)
    return value if isinstance(value, int) else None


def _weights(index: Tensor, out: Tensor) -> Tensor:
    """Fixed weights per (token of the probe batch, output feature), shaped as `out` ``[b, s, ...]``: a token meets the
    same weights in the split and the unsplit pass because they depend on its index in the whole batch only."""
    features = out[0, 0].numel()
    phase = index.to(torch.float64).unsqueeze(-1) * 0.618 + torch.arange(features, device=out.device) * 1.414
    return torch.cos(phase).to(out.dtype).reshape(out.shape)


class ProbeLoss:
    """The probe's loss: ``sum(output x weights) / tokens`` of the whole batch, times `scale` (cp in the split pass:
    FSDP averages the gradients over the cp ranks, as in training). An output without a row per token of `index`
    (pooled over the sequence) is noted in ``pooled`` and still given a loss: inside a pipeline schedule nothing may
    raise on one rank only."""

    def __init__(self, tokens: int, scale: float = 1.0) -> None:
        self.tokens, self.scale, self.pooled = tokens, scale, False

    def __call__(self, out: Tensor, index: Tensor) -> Tensor:
        out = output_tensor(out)
        if out.dim() < 2 or tuple(out.shape[:2]) != tuple(index.shape[:2]):
            self.pooled = True
            return out.sum() * 0.0
        return (out * _weights(index, out)).sum() * (self.scale / self.tokens)


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else getattr(t, "_local_tensor", t)


def _clear(params: Sequence[tuple[str, Tensor]]) -> None:
    for _, p in params:
        p.grad = None


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    # NaN as infinity: a reduction's max may drop a NaN, and a NaN on one rank must fail every rank
    t = torch.tensor([math.inf if math.isnan(v) else v for v in values], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # one verdict on every rank
    return t.tolist()


def _relative(got: Tensor, want: Tensor) -> float:
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def _output_diff(whole: Optional[Tensor], part: Optional[Tensor], positions: Tensor) -> float:
    if whole is None or part is None:
        return 0.0  # a pipeline rank without the last stage: its stages are judged by their gradients
    return _relative(part, whole.index_select(1, positions.to(whole.device)))


def _own_rounding(
    probe: CPProbe, params: Sequence[tuple[str, Tensor]], reference: dict, whole: Optional[Tensor], index: Tensor
) -> float:
    """How far the unsplit model differs from itself when only the order of its sums changes: the same pass over the
    probe's rows in reverse order (each token keeps its loss weight). ~1e-16 in float64; float32's rounding where the
    model computes parts in float32. Every rank runs it (a pipeline's schedule)."""
    inputs = probe.inputs
    _clear(params)
    try:
        probe.inputs = inputs.flip(0)
        again = probe.run(split=False, loss=ProbeLoss(index.numel()), index=index.flip(0))
    finally:
        probe.inputs = inputs
    out = 0.0 if whole is None or again is None else _relative(again.flip(0), whole)
    return max(out, _grad_diffs(params, reference)[0])


def _grad_diffs(params: Sequence[tuple[str, Tensor]], reference: dict[str, Optional[Tensor]]) -> tuple[float, str]:
    """(largest relative gradient difference on this rank, its parameter) against the unsplit pass's gradients."""
    total = math.sqrt(sum(float(r.double().norm()) ** 2 for r in reference.values() if r is not None))
    worst, name = 0.0, ""
    for n, p in params:
        got, want = _local(p.grad), reference[n]
        if got is None and want is None:
            continue
        got = torch.zeros_like(want) if got is None else got
        want = torch.zeros_like(got) if want is None else want
        if want.numel() == 0:
            continue
        scale = max(float(want.double().norm()), _GRAD_FLOOR * total, 1e-300)
        rel = float((got.double() - want.double()).norm()) / scale
        if not rel <= worst:  # NaN counts as the worst
            worst, name = rel, n
    return worst, name


def run_cp_probe(probe: CPProbe, state: Any, params: Sequence[tuple[str, Tensor]], *, sample: str) -> ProbeReport:
    """Run `probe`'s batch unsplit and split (forward and backward each) and refuse a split that differs from the
    whole beyond rounding (ValueError naming the module, the parameter and the likely reason). Collective: call on
    every rank; every rank raises or returns together. `state`: the strategy's
    :class:`~lightning_dist.parallelize.cp.ContextParallel`; `params`: what the optimizer updates (their ``.grad``
    is cleared before and after)."""
    start = time.perf_counter()
    batch, seq = probe.inputs.shape[:2]
    device = next((p.device for _, p in params), probe.inputs.device)
    index = torch.arange(batch * seq, device=device).view(batch, seq)  # each token's place in the probe batch
    calls, last = state.calls, state.last
    try:
        _clear(params)
        whole_loss = ProbeLoss(batch * seq)
        whole = probe.run(split=False, loss=whole_loss, index=index)
        reference = {n: None if p.grad is None else _local(p.grad).detach().clone() for n, p in params}
        floor = _own_rounding(probe, params, reference, whole, index)
        _clear(params)
        part_loss = ProbeLoss(batch * seq, scale=state.cp.size)
        before = state.calls
        part = probe.run(split=True, loss=part_loss, index=index)
        served = state.calls - before
        positions = state.last.positions
        pooled = whole_loss.pooled or part_loss.pooled
        out_diff = 0.0 if pooled else _output_diff(whole, part, positions)
        local_grad, worst = _grad_diffs(params, reference)
        # the loosest rounding of what this rank computed in (a pipeline rank without the output: its parameters')
        dtypes = [t.dtype for t in (whole, part) if t is not None] + [p.dtype for _, p in params]
        tol = max((_TOLERANCE.get(d, 1e-4) for d in dtypes), default=1e-4)
        verdict = _max_over_ranks([float(pooled), float(served), out_diff, local_grad, tol, floor], device)
    finally:
        _clear(params)
        state.calls, state.last = calls, last  # the probe's calls are not training's
    pooled, served, out_diff, grad_diff, tol, floor = bool(verdict[0]), int(verdict[1]), *verdict[2:]
    # a model that computes parts in float32 whatever its parameters' dtype (norms, routers) is held to its own
    # rounding, with margin, up to float32's tolerance: a split that is wrong differs by far more
    tol = max(tol, min(_FLOOR_MARGIN * floor, _TOLERANCE[torch.float32]))
    if pooled or served == 0 or not (out_diff <= tol and grad_diff <= tol):
        refusal = _Refusal(probe, state, index, tol=tol, sample=sample)
        worst = _gathered_worst(local_grad, worst)
        raise ValueError(
            refusal.explain(pooled=pooled, served=served, out_diff=out_diff, grad_diff=grad_diff, worst=worst)
        )
    return ProbeReport(out_diff, grad_diff, served, time.perf_counter() - start, sample, floor)


class _Refusal:
    """The refusal's message, found with a few more forward-only passes (every rank runs them together: the verdict
    was all-reduced first)."""

    def __init__(self, probe: CPProbe, state: Any, index: Tensor, *, tol: float, sample: str) -> None:
        self.probe, self.state, self.index, self.tol = probe, state, index, tol
        self.sample = sample

    def explain(self, *, pooled: bool, served: int, out_diff: float, grad_diff: float, worst: str) -> str:
        reasons = self._reasons(pooled=pooled, served=served, out_diff=out_diff)
        if pooled:
            found = "the split output has no row per token to compare"
        else:
            most = f"; most on `{worst}`" if worst and grad_diff > 0 else ""
            found = (
                f"the split output differs by {out_diff:.1e} and the gradients by {grad_diff:.1e} (max relative,"
                f" allowed {self.tol:.0e}: the model's own rounding, with margin, or its dtype's{most})"
                f"{self._first_module()}"
            )
        return (
            f"Context parallelism (cp={self.state.cp.size}, {self.state.cp.style}) would train a different model than"
            f" one device: its setup self-check ran {self.sample} split and unsplit through the model (forward and"
            f" backward), and {found}.\n  Likely reason: "
            + "\n  Or: ".join(reasons)
            + "\n  (A model known to be exact under cp can skip this check with self_check=False.)"
        )

    def _reasons(self, *, pooled: bool, served: int, out_diff: float) -> list[str]:
        """The likely reasons, from what the check measured (the positions test: two more unsplit forwards)."""
        reasons = []
        if pooled:
            reasons.append(
                f"the network's output has no row per token of the {self.sample}: it is pooled over the sequence"
                " (sequence classification, a last-token or mean pooling), and under cp each rank pools only its part"
                " of each sequence. Use cp=1 for models whose output is per sequence."
            )
        elif served == 0:
            reasons.append(
                "no attention call went through the exchange (0 calls of F.scaled_dot_product_attention): the model"
                " computes its attention by hand (softmax(q @ k.T / sqrt(d) + mask) @ v, or another kernel), so each"
                " rank attends within its own chunks of the sequence. Call"
                " F.scaled_dot_product_attention(q, k, v, is_causal=True) in the attention (HF models:"
                " attn_implementation='sdpa'), or use cp=1."
            )
        else:
            if self._positions_ignored():
                reasons.append(
                    "the network's output does not change when it is given other `position_ids`: it numbers its"
                    " tokens' positions itself (e.g. torch.arange(seq_len)), so each rank places its chunks at"
                    " positions 0, 1, ... instead of where they are in the sequence. Make the positional embedding"
                    " use the `position_ids` argument (learned: weight[position_ids]; rotary: their angles), or use"
                    " cp=1."
                )
            if out_diff <= self.tol:
                reasons.append(
                    "the outputs agree and the gradients do not: a parameter's gradient is not averaged over the cp"
                    f" ranks (each of the {self.state.cp.size} holds its own chunks' gradient). A parallelize_fn"
                    " must shard (or replicate) the parameters over dp_shard x cp, as the built-in plans do."
                )
            if not reasons:
                reasons.append(
                    "an attention computed outside F.scaled_dot_product_attention beside those the exchange serves, a"
                    " mask or positions built from the local sequence length, or another use of the whole sequence"
                    " inside the network. Use cp=1 for this model."
                )
        return reasons

    def _forward(self, *, split: bool, position_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        return self.probe.run(split=split, loss=None, index=self.index, position_ids=position_ids)

    def _positions_ignored(self) -> bool:
        """Whether the unsplit output stays the same under reversed ``position_ids`` (on every rank's output)."""
        batch, seq = self.index.shape
        ids = torch.arange(seq, device=self.index.device).expand(batch, -1)
        given, reversed_ = (
            self._forward(split=False, position_ids=ids),
            self._forward(split=False, position_ids=ids.flip(1)),
        )
        changed = 0.0 if given is None or reversed_ is None else _relative(reversed_, given)
        has = 0.0 if given is None else 1.0
        changed, has = _max_over_ranks([changed, has], self.index.device)
        return has > 0 and changed <= self.tol

    def _first_module(self) -> str:
        """``"; the first module ... : `name`"`` found by forward-only passes with hooks, or ``""``: the first module
        (in the order calls end) whose output differs while its input agrees, else the first whose output differs."""
        whole, part = _Outputs(self.probe.modules()), _Outputs(self.probe.modules())
        with whole:
            self._forward(split=False)
        with part:
            self._forward(split=True)
        positions, self.state.last = self.state.last.positions, None
        differs = lambda a, b: a is not None and b is not None and not self._agrees(a, b, positions)  # noqa: E731
        culprit = first = None
        for i, ((name, a_in, a), (other, b_in, b)) in enumerate(zip(whole.seen, part.seen)):
            if name != other:
                break  # the two passes called different modules: nothing to compare from here
            if differs(a, b):
                first = first or (self.probe.order, i, name)
                if not differs(a_in, b_in):
                    culprit = (self.probe.order, i, name)
                    break
        found = [f for f in _gather((culprit, first)) if f != (None, None)]
        culprits = [c for c, _ in found if c is not None]
        if culprits:
            return f"; the first module whose output differs from the same input: `{min(culprits)[2]}`"
        firsts = [f for _, f in found if f is not None]
        return f"; the first module whose output differs: `{min(firsts)[2]}`" if firsts else ""

    def _agrees(self, whole: Tensor, part: Tensor, positions: Tensor) -> bool:
        if whole.shape[0] != part.shape[0] or whole.shape[1] != part.shape[1] * self.state.cp.size:
            return True  # not one row per token in both passes: nothing to compare
        return _relative(part, whole.index_select(1, positions.to(whole.device))) <= self.tol


def _gather(value: Any) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _gathered_worst(local: float, name: str) -> str:
    """The parameter whose gradient differs most over all ranks (each rank holds its own shards or stages)."""
    gathered = [(-1.0 if math.isnan(v) else v, n) for v, n in _gather((local, name)) if n]
    return max(gathered)[1] if gathered else ""


class _Outputs:
    """Records, during one forward, a fixed projection of each module call's first input and output that hold a row
    per token (``[b, s]`` doubles each): enough to find the module where the split starts to differ, without keeping
    activations."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.modules = modules
        self.seen: list[tuple[str, Optional[Tensor], Tensor]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _Outputs:
        for name, module in self.modules:
            self.handles.append(module.register_forward_hook(lambda m, a, out, name=name: self.add(name, a, out)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def add(self, name: str, args: tuple, out: Any) -> None:
        projected = _project(out)
        if projected is not None:
            self.seen.append((name, _project(args[0]) if args else None, projected))


def _project(t: Any) -> Optional[Tensor]:
    """``[b, s]``: each row of a ``[b, s, ...]`` float tensor times fixed weights; None for anything else (token ids,
    DTensors: a tensor-parallel shard's layout is not a token's)."""
    if type(t) is not Tensor or t.dim() < 2 or not t.is_floating_point():
        return None
    flat = t.detach().double().flatten(2) if t.dim() > 2 else t.detach().double().unsqueeze(-1)
    w = torch.cos(torch.arange(flat.shape[-1], device=flat.device, dtype=torch.float64) * 1.414 + 0.5)
    return flat @ w


@contextlib.contextmanager
def evaluating(*roots: nn.Module) -> Iterator[None]:
    """`roots` in eval mode inside; each module's own mode restored after (a frozen part stays in eval)."""
    modes = [(m, m.training) for root in roots for m in root.modules()]
    for root in roots:
        root.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def module_names(root: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """`root`'s modules named as in the unwrapped model (without activation checkpointing's and compile's wrappers)."""
    out = []
    for name, module in root.named_modules():
        for wrapper in ("._checkpoint_wrapped_module", "_checkpoint_wrapped_module.", "._orig_mod", "_orig_mod."):
            name = name.replace(wrapper, "")
        out.append((f"{prefix}.{name}" if name else prefix, module))
    return out


class NetworkProbe:
    """The probe's passes through a network hooked by :func:`~lightning_dist.parallelize.cp.apply_cp` (what every
    strategy but the pipeline runs): the hook cuts the inputs in the split pass and passes them through in the
    unsplit one (:meth:`~lightning_dist.parallelize.cp.ContextParallel.unsplit`)."""

    order = 0

    def __init__(self, state: Any, network: nn.Module, name: str, inputs: Tensor, *, forward_context: Any) -> None:
        self.state, self.network, self.name = state, network, name
        self.inputs, self.forward_context = inputs, forward_context

    def run(
        self, *, split: bool, loss: Optional[ProbeLoss], index: Tensor, position_ids: Optional[Tensor] = None
    ) -> Optional[Tensor]:
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        with evaluating(self.network):  # no dropout: both passes compute the same function
            # eager even where blocks are compiled: a compile for the probe's sizes would cost a compile and mark
            # the sizes dynamic for training's; the backward inside the mode choice too (checkpointed blocks
            # recompute under `active`, a no-op in the unsplit pass)
            with self.state.active() if split else self.state.unsplit(), torch.compiler.set_stance("force_eager"):
                with torch.set_grad_enabled(loss is not None), self.forward_context():
                    out = self._call(kwargs)
                if loss is not None:
                    target = self.state.split_target(out, index) if split else None
                    loss(out, index if target is None else target).backward()
        return out.detach()

    def _call(self, kwargs: dict) -> Tensor:
        """The network's output tensor on the probe batch; a network that takes other inputs or returns no tensor is
        refused naming the fixes (every rank alike: the same network and batch)."""
        what = f"{type(self.network).__name__} on its probe batch {tuple(self.inputs.shape)}"
        fix = "Set `example_input_array` to the network's input (token ids), or pass self_check=False."
        try:
            out = output_tensor(self.network(self.inputs, **kwargs))
        except TypeError as err:  # a forward that needs more arguments than the token ids
            raise ValueError(f"The context-parallel self-check could not call {what}: {err}. {fix}") from err
        if out is None:
            raise ValueError(f"The context-parallel self-check found no tensor in the output of {what}. {fix}")
        return out

    def modules(self) -> list[tuple[str, nn.Module]]:
        return module_names(self.network, self.name)


__all__ = [
    "CPProbe",
    "NetworkProbe",
    "ProbeLoss",
    "ProbeReport",
    "run_cp_probe",
    "evaluating",
    "module_names",
    "output_tensor",
    "probe_inputs",
]
