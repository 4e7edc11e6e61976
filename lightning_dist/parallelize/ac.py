"""Activation checkpointing per block (``full``, ``selective``, ``every:N``) and activation offload to host memory.

Notes: docs/internals.md, "lightning_dist/parallelize/ac.py"."""

from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_dist.parallelize.units import select_units

log = logging.getLogger(__name__)

# what this module did to a block, kept beside it (weakly: the block's lifetime), not as attributes on it
_CHECKPOINTED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_OFFLOADED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

ACOption = Union[bool, str, Sequence[str]]

SELECTIVE_AC_OPS: tuple[str, ...] = (
    # matmuls (nn.Linear lowers to mm / addmm, attention's math path to bmm)
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    # fused attention kernels (CUDA flash / memory-efficient / cuDNN, CPU flash)
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    # collectives issued inside a block (functional collectives): recomputing them would communicate again
    "_c10d_functional.all_reduce",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_to_all_single",
)
"""Ops whose outputs ``activation_checkpointing="selective"`` keeps (``namespace.op`` under ``torch.ops``); of the
``aten.mm`` / ``aten.addmm`` calls among them, every second one per block forward is recomputed instead."""

_FORMS = 'False, True / "full", "selective", "every:N" (N an integer >= 1) or block class names (e.g. ["GPTBlock"])'


@dataclass(frozen=True, kw_only=True)
class ACPlan:
    """What :func:`apply_ac` does, parsed from an ``activation_checkpointing=`` value."""

    mode: str
    """``"full"`` or ``"selective"``."""
    every: int = 1
    """Checkpoint the blocks N, 2N, ... (counted from 1) of the units; 1: every unit."""
    units: Union[str, tuple[str, ...]] = "auto"
    """``"auto"`` (the model's blocks) or block class names."""
    ops: tuple[str, ...] = SELECTIVE_AC_OPS
    """Ops whose outputs selective AC keeps."""


def resolve_ops(names: Sequence[Any]) -> list[Any]:
    """The ``torch.ops`` op packets / overloads named by `names` (``"aten.mm"``, ``"aten.mm.default"``, or op
    objects); ValueError naming the ones torch does not have."""
    out, missing = [], []
    for name in names:
        if isinstance(name, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            out.append(name)
            continue
        obj: Any = torch.ops
        try:
            for part in str(name).split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            obj = None
        if isinstance(obj, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            out.append(obj)
        elif name not in SELECTIVE_AC_OPS:  # a default kernel this build lacks is never called: not an error
            missing.append(name)
    if missing:
        raise ValueError(
            f"`selective_ac_ops`: {missing} are not torch ops; name them as 'namespace.op' under"
            " torch.ops (e.g. 'aten.mm', 'aten._scaled_dot_product_flash_attention')."
        )
    return out


def ac_problems(value: Any, *, selective_ops: Any = None, offload_activations: Any = False) -> list[str]:
    """Problems with the activation options of a strategy (empty when valid); pure, same on every rank."""
    problems = []
    plan = None
    try:
        plan = parse_ac(value, ops=selective_ops)
    except ValueError as err:
        problems.append(str(err))
    if selective_ops is not None and (plan is None or plan.mode != "selective"):
        problems.append(
            f"`selective_ac_ops` is used by activation_checkpointing='selective' only; got"
            f" activation_checkpointing={value!r}."
        )
    if not isinstance(offload_activations, bool):
        problems.append(f"`offload_activations={offload_activations!r}` must be True or False.")
    elif offload_activations and plan is not None and plan.every == 1:
        problems.append(
            f"offload_activations=True with activation_checkpointing={value!r}: every block is"
            " checkpointed, so no block keeps activations to offload. Use activation_checkpointing="
            "'every:N' (the blocks between the checkpointed ones are offloaded) or False."
        )
    return problems


def split_backward_problems(value: Any, schedule: str) -> list[str]:
    """Problems of activation checkpointing under a schedule that splits the backward into input- and
    weight-gradient passes (zero-bubble): selective AC's saved outputs serve one backward only (torch raises
    "Trying to backward an extra time" in the second pass)."""
    try:
        plan = parse_ac(value)
    except ValueError:
        return []  # reported by ac_problems
    if plan is not None and plan.mode == "selective":
        return [
            f"activation_checkpointing='selective' with schedule={schedule!r}: a zero-bubble schedule runs each"
            " micro-batch's backward in two passes (input gradients, then weight gradients), and torch's"
            " selective checkpoint serves one backward only. Use activation_checkpointing='full' or 'every:N'"
            " (recomputed in each pass), or schedule='1f1b' / 'interleaved_1f1b' with 'selective'."
        ]
    return []


def check_offload_device(offload_activations: bool, device: Any) -> None:
    """ValueError when activations would be offloaded from a device that is host memory already."""
    if offload_activations and torch.device(device).type != "cuda":
        raise ValueError(
            f"offload_activations=True needs a CUDA device: on {torch.device(device).type!r} the"
            " activations already are in host memory (there is nothing to offload them to). Pass"
            " offload_activations=False, or activation_checkpointing='selective' to save memory."
        )


def parse_ac(value: Any, *, ops: Any = None) -> ACPlan | None:
    """The :class:`ACPlan` of an ``activation_checkpointing=`` value (None: off); ValueError naming the value."""
    if value is None or value is False:
        return None
    if value is True or value == "full":
        return ACPlan(mode="full")
    if value == "selective":
        if ops is not None and (isinstance(ops, str) or not isinstance(ops, Sequence) or not ops):
            raise ValueError(f"`selective_ac_ops={ops!r}` must be a non-empty list of op names (e.g. ['aten.mm']).")
        if ops is not None:
            resolve_ops(ops)
        return ACPlan(mode="selective", ops=SELECTIVE_AC_OPS if ops is None else tuple(ops))
    if isinstance(value, str) and value.startswith("every:"):
        n = value[len("every:") :]
        # ASCII digits only: str.isdigit() accepts '²' and other digits int() refuses
        if n.isascii() and n.isdigit() and int(n) >= 1:
            return ACPlan(mode="full", every=int(n))
        raise ValueError(
            f"`activation_checkpointing={value!r}`: N in 'every:N' must be an integer >= 1"
            " (e.g. 'every:2' checkpoints every second block)."
        )
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return ACPlan(mode="full", units=tuple(value))
    raise ValueError(f"`activation_checkpointing={value!r}` must be one of {_FORMS}.")


def _selective_context(ops: Sequence[Any], *, alternate_matmuls: bool = True) -> Any:
    """``context_fn`` for torch's checkpoint: keep the outputs of `ops`, recompute everything else; with
    `alternate_matmuls`, the 2nd, 4th, ... ``mm``/``addmm`` of each checkpointed forward are recomputed too."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    _MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm}
    resolved = resolve_ops(ops)
    packets = {op for op in resolved if isinstance(op, torch._ops.OpOverloadPacket)}
    overloads = {op for op in resolved if isinstance(op, torch._ops.OpOverload)}

    def policy(counts: dict[str, int], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        keep = op in overloads or getattr(op, "overloadpacket", None) in packets
        if keep and alternate_matmuls and getattr(op, "overloadpacket", op) in _MATMULS:
            # torchtitan's op-level rule: of the matmuls, every second one is recomputed. Counted per
            # pass, so the recompute in backward makes the same choices as the forward did.
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            keep = counts[mode] % 2 == 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn() -> Any:  # one call per checkpointed forward: fresh counts
        return create_selective_checkpoint_contexts(partial(policy, {"forward": 0, "recompute": 0}))

    return context_fn


def apply_ac(
    model: nn.Module,
    *,
    units: Union[str, Sequence[str], Sequence[nn.Module]] = "auto",
    mode: str = "full",
    every: int = 1,
    ops: Sequence[Any] = SELECTIVE_AC_OPS,
    recompute_context: Any = None,
    split_backward: bool = False,
) -> list[nn.Module]:
    """Checkpoint each unit (each block by default; every `every`-th with ``every > 1``); returns the wrapped.

    `recompute_context`: a factory of a context manager each recomputation (in backward) runs under, as the forward
    ran under the step's: context parallelism's attention mode (torch's autograd engine does not carry a
    ``TorchFunctionMode`` into backward).

    `split_backward`: the schedule computes input and weight gradients in two passes over the graph (zero-bubble
    pipelines), so each checkpointed block is recomputed twice: full AC then runs through
    ``torch.utils.checkpoint.checkpoint`` of the forward, which recomputes once per pass (torch's composable
    ``checkpoint`` enters a one-shot context per forward and fails at the second); selective AC cannot (torch's
    cache of the saved ops serves one backward) and is refused by :func:`split_backward_problems`.

    ``mode="full"``: torch's composable ``checkpoint`` (non-reentrant, hooks on the module);
    ``mode="selective"``: ``torch.utils.checkpoint.checkpoint`` of the module's forward with a selective
    ``context_fn`` keeping the outputs of `ops` (see :func:`_checkpoint_forward`). Both keep the module's class
    and its state-dict keys, so checkpoints stay loadable without AC. Call before ``apply_compile`` and
    ``apply_fsdp``.
    """
    from torch.distributed._composable import checkpoint

    if not isinstance(units, str) and units and all(isinstance(u, nn.Module) for u in units):
        picked = list(units)
    else:
        picked = [module for _, module in select_units(model, units)]
    wrapped = [m for i, m in enumerate(picked) if (i + 1) % every == 0]
    context_fn = _selective_context(ops) if mode == "selective" else None
    if recompute_context is not None:
        context_fn = _recompute_under(context_fn, recompute_context)
    if split_backward and mode == "full" and context_fn is None:
        from torch.utils.checkpoint import noop_context_fn

        context_fn = noop_context_fn
    for module in wrapped:
        _CHECKPOINTED[module] = mode  # read by the planners (checkpointed_mode)
        # first of its pre-hooks, so that the checkpoint records (and its recompute replays) the call without a cache
        module.register_forward_pre_hook(_without_kv_cache, with_kwargs=True, prepend=True)
        if split_backward and mode == "full":
            _checkpoint_forward(module, context_fn)
        elif context_fn is None:
            checkpoint(module)
        elif mode == "full":
            checkpoint(module, context_fn=context_fn)
        else:
            _checkpoint_forward(module, context_fn)
    log.info("applied %s activation checkpointing to %d of %d blocks", mode, len(wrapped), len(picked))
    return wrapped


def checkpointed_mode(module: nn.Module) -> Optional[str]:
    """``"full"`` or ``"selective"`` when :func:`apply_ac` checkpointed `module` (or the module it wraps), else None."""
    inner = getattr(module, "_orig_mod", module)  # a compiled block
    return _CHECKPOINTED.get(module) or _CHECKPOINTED.get(inner)


# keyword arguments through which a block is handed a KV cache to write (transformers' names for it)
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def _without_kv_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Optional[tuple[tuple, dict]]:
    """Forward pre-hook of a checkpointed block: with gradients on, call it without a KV cache (``use_cache=False``,
    the cache arguments None), as transformers' own checkpointing does. A block that appends its keys and values to
    a cache in forward would append them again in the recompute, which then runs on twice the keys: other ops than
    the forward's (torch's selective checkpoint refuses them: "invocation index ... not found in storage"), or a
    shape error against the attention mask. A training step never reads that cache."""
    cached = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if not torch.is_grad_enabled() or not (cached or kwargs.get("use_cache")):
        return None
    from lightning_dist._integrations.transformers_cache import reads_cache_only

    if reads_cache_only(module):
        return None
    return args, {**kwargs, **dict.fromkeys(cached), **({"use_cache": False} if "use_cache" in kwargs else {})}


class _Both:
    """``first`` and a fresh ``extra()`` entered together, as often as it is entered: a zero-bubble schedule's
    input-gradient and weight-gradient passes each recompute a checkpointed block (a generator-based context
    manager can be entered only once)."""

    def __init__(self, first: Any, extra: Any) -> None:
        self.first, self.extra, self.stacks = first, extra, []

    def __enter__(self) -> None:
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(self.first)
        stack.enter_context(self.extra())
        self.stacks.append(stack)

    def __exit__(self, *exc: Any) -> Any:
        return self.stacks.pop().__exit__(*exc)


def _recompute_under(context_fn: Any, extra: Any) -> Any:
    """A checkpoint ``context_fn`` whose recomputation also runs under ``extra()``."""
    import contextlib

    def fn() -> Any:
        forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(),) * 2
        return forward, _Both(recompute, extra)

    return fn


def _checkpoint_forward(module: nn.Module, context_fn: Any) -> None:
    """Run `module`'s forward under ``torch.utils.checkpoint.checkpoint(..., context_fn=context_fn)``.

    Through its ``forward`` (a bound method set on the instance, so ``deepcopy`` rebinds it to the copy; class
    and state-dict keys unchanged) rather than the composable hooks: ``torch.compile`` of the block then
    captures the checkpoint as one region with its selective policy, which it cannot do from hooks (the cached
    outputs would be seen as mutated).
    """
    module.forward = types.MethodType(_CheckpointedForward(context_fn), module)


class _CheckpointedForward:
    """A block's class forward under ``checkpoint`` with `context_fn`, bound to the block as its ``forward``."""

    def __init__(self, context_fn: Any) -> None:
        self.context_fn = context_fn

    def __call__(self, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        forward = type(block).forward.__get__(block)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


class _Saved:
    """One offloaded tensor: its device, host copy, the event of that copy, and a prefetched device copy."""

    __slots__ = ("device", "host", "copied", "fetched", "ready", "group", "__weakref__")

    def __init__(self, device: Any, host: Tensor, copied: Any, group: "_Group") -> None:
        self.device, self.host, self.copied, self.group = device, host, copied, group
        self.fetched: Optional[Tensor] = None
        self.ready: Any = None


class _Group:
    """The tensors one block's forward offloaded (weakly: autograd owns them), and the group whose forward ran just
    before it (weakly), which its backward prefetches."""

    __slots__ = ("saved", "previous", "started", "__weakref__")

    def __init__(self, previous: Optional["_Group"]) -> None:
        self.saved: list[Any] = []
        self.previous = weakref.ref(previous) if previous is not None else None
        self.started = False  # its backward has begun (nothing left to prefetch)


class _Chain:
    """The last block forward that offloaded, shared by the blocks of one model (forward order = reverse of
    backward order, so the block before is the one whose tensors backward needs next)."""

    def __init__(self) -> None:
        self.last: Optional[_Group] = None


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to (pinned) host memory in forward, back to their device in backward; parameters stay.

    torch's ``save_on_cpu`` packing, except that parameters (kept alive by the module anyway) are not copied, and
    that with a `stream` (CUDA: one side stream per device, :func:`apply_offload_activations`) the copies run on
    that stream, overlapped with the compute on the compute stream:

    * forward: the side stream waits for the compute stream (the copy reads the tensor after the op that made it),
      copies to host, and marks the saved tensor used by the side stream (``record_stream``), so that the caching
      allocator does not hand its memory to a later op before the copy has read it (autograd drops it at once);
    * backward: the first tensor a block's backward unpacks starts the copies back of the block that ran forward
      just before it (the next one backward needs) on the side stream, overlapped with this block's backward;
      the compute stream waits for a prefetched tensor's event (a GPU-side wait) and the tensor is marked used by
      it. A tensor not prefetched (the first block's backward, a second backward pass of a zero-bubble schedule)
      is copied back on the compute stream after waiting for its copy to host.

    Without a stream the copies are queued on the current stream (``non_blocking`` with pinned memory). ``bytes``
    counts what was moved to host memory since the block's last forward started (measured, for ``MemoryReport``).
    Written here because torch's ``save_on_cpu`` copies on the compute stream, does not prefetch and copies
    parameters too.
    """

    def __init__(
        self, *, pin_memory: bool, device_type: str = "cuda", stream: Any = None, chain: Optional[_Chain] = None
    ) -> None:
        self.bytes = 0
        self.stream = stream
        self.chain = chain if chain is not None else _Chain()
        self._group: Optional[_Group] = None
        device_module = torch.get_device_module(device_type) if stream is not None else None

        def pack(t: Tensor) -> Any:
            if isinstance(t, nn.Parameter) or t.device.type != device_type:
                return t
            # same strides as `t` (a saved weight.t() stays transposed: backward's matmuls round as without offload)
            host = torch.empty_like(t, device="cpu", pin_memory=pin_memory)
            self.bytes += host.numel() * host.element_size()
            group = self._group if self._group is not None else _Group(None)
            if stream is None:
                host.copy_(t, non_blocking=pin_memory)
                saved = _Saved(t.device, host, None, group)
            else:
                stream.wait_stream(device_module.current_stream(t.device))
                with device_module.stream(stream):
                    host.copy_(t, non_blocking=pin_memory)
                t.record_stream(stream)
                saved = _Saved(t.device, host, stream.record_event(), group)
            group.saved.append(weakref.ref(saved))
            return saved

        def prefetch(group: Optional[_Group]) -> None:
            if group is None or group.started:
                return
            with device_module.stream(stream):  # after the copies to host: the same stream, in order
                for ref in group.saved:
                    saved = ref()
                    if saved is not None and saved.fetched is None:
                        saved.fetched = saved.host.to(saved.device, non_blocking=pin_memory)
                        saved.ready = stream.record_event()

        def unpack(saved: Any) -> Tensor:
            if isinstance(saved, Tensor):
                return saved
            group = saved.group
            if stream is not None and not group.started:
                group.started = True
                prefetch(group.previous() if group.previous is not None else None)
            if saved.fetched is not None:  # prefetched on the side stream
                out, saved.fetched = saved.fetched, None
                compute = device_module.current_stream(saved.device)
                compute.wait_event(saved.ready)
                out.record_stream(compute)
                return out
            if saved.copied is not None:
                device_module.current_stream(saved.device).wait_event(saved.copied)
            return saved.host.to(saved.device, non_blocking=pin_memory)

        super().__init__(pack, unpack)

    def start(self, *_: Any) -> None:
        self.bytes = 0
        self._group = self.chain.last = _Group(self.chain.last)
        self.__enter__()

    def stop(self, *_: Any) -> None:
        self.__exit__(None, None, None)
        self._group = None


def apply_offload_activations(
    model: nn.Module,
    *,
    units: Union[str, Sequence[str], Sequence[nn.Module]] = "auto",
    skip: Sequence[nn.Module] = (),
    pin_memory: bool = True,
    device_type: str = "cuda",
    stream: Any = "auto",
) -> list[OffloadedActivations]:
    """Offload the tensors each unit saves for backward from `device_type` to host memory (not those of `skip`:
    the checkpointed blocks); returns one hook object per unit (:func:`offload_hooks` finds them). The hooks
    are entered and left around each unit's forward."""
    if not isinstance(units, str) and units and all(isinstance(u, nn.Module) for u in units):
        picked = list(units)
    else:
        picked = [module for _, module in select_units(model, units)]
    skipped = {id(m) for m in skip}
    out = []
    if stream == "auto":  # one side stream for the copies of all blocks (CUDA; else on the current stream)
        stream = torch.cuda.Stream() if device_type == "cuda" and torch.cuda.is_available() else None
    chain = _Chain()  # the blocks' forward order, for the prefetch in backward
    for module in (m for m in picked if id(m) not in skipped):
        hooks = OffloadedActivations(pin_memory=pin_memory, device_type=device_type, stream=stream, chain=chain)
        module.register_forward_pre_hook(hooks.start)
        module.register_forward_hook(hooks.stop, always_call=True)
        _OFFLOADED[module] = hooks
        out.append(hooks)
    log.info(
        "offloading the saved activations of %d blocks to %shost memory", len(out), "pinned " if pin_memory else ""
    )
    return out


def offloaded_bytes(model: nn.Module) -> int | None:
    """Bytes the blocks of `model` moved to host memory in their last forward; None when nothing is offloaded."""
    hooks = offload_hooks(model)
    return sum(h.bytes for h in hooks) if hooks else None


def offload_hooks(model: nn.Module) -> list[OffloadedActivations]:
    """The hooks :func:`apply_offload_activations` put on the blocks of `model`, in module order."""
    return [_OFFLOADED[m] for m in model.modules() if m in _OFFLOADED]


__all__ = [
    "ACOption",
    "ACPlan",
    "OffloadedActivations",
    "SELECTIVE_AC_OPS",
    "ac_problems",
    "apply_ac",
    "apply_offload_activations",
    "check_offload_device",
    "offload_hooks",
    "offloaded_bytes",
    "parse_ac",
    "resolve_ops",
    "split_backward_problems",
]
