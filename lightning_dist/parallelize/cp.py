"""Context parallelism: each sequence split over the ``cp`` ranks, attention exact over the whole sequence.

Notes: docs/internals.md, "lightning_dist/parallelize/cp.py"."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dist import _compat
from lightning_dist._compat import all_to_all_autograd
from lightning_dist.rules import cp_chunks

log = logging.getLogger(__name__)

CP_STYLES = ("ulysses", "ring")
HF_ATTENTION = "lightning_dist_cp"
"""The attention implementation name the pack registers with transformers for HF models under cp."""
_SDPA = F.scaled_dot_product_attention


def cp_style_problems(cp_style: Any, cp: Any, device_type: Optional[str] = None) -> list[str]:
    """Problems of the ``cp_style`` option (collected into the strategy's one ValueError)."""
    if cp_style not in CP_STYLES:
        return [f"`cp_style={cp_style!r}` must be one of {CP_STYLES}."]
    if cp_style == "ring" and isinstance(cp, int) and cp > 1 and device_type not in (None, "cpu", "cuda"):
        return [
            f"`cp_style='ring'` runs torch's ring attention with the CPU or CUDA attention kernels; this run is on"
            f" {device_type!r}. Use cp_style='ulysses' (all-to-all; every device)."
        ]
    return []


def attention_heads(network: nn.Module) -> Optional[int]:
    """The attention heads of a known network (HF config or the pack's GPT), else None. Key/value heads need no
    check: those that do not divide over cp are repeated first (:func:`ulysses_sdpa`)."""
    config = getattr(network, "config", None)
    return getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)


def attention_shape(network: nn.Module) -> Optional[tuple[int, int, int]]:
    """(query heads, key/value heads, head dim) of a known network (HF config or the pack's GPT), else None: what
    the planner needs for the all-to-all bytes (:func:`~lightning_dist.planner.cp_attention_traffic`)."""
    config = getattr(network, "config", None)
    heads = attention_heads(network)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not isinstance(heads, int) or not isinstance(hidden, int):
        return None
    # the key/value heads that reach SDPA: HF's SDPA attention passes the grouped ones (enable_gqa; cp's mask is
    # None); the pack's attention (models/layers.py) repeats them to the query heads first
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or hidden // heads


def recomputes_attention(block: nn.Module) -> bool:
    """Whether activation checkpointing of `block` repeats its attention's forward all-to-alls in backward."""
    from lightning_dist.parallelize.ac import checkpointed_mode

    # selective AC keeps the all-to-alls' outputs (collectives are in its saved op list): measured, 16 calls per
    # step at 2 blocks as without AC; full AC recomputes the block's forward, 4 more per block
    return checkpointed_mode(block) == "full"


def planned_attention_traffic(
    network: nn.Module,
    block_lists: Any,
    *,
    batch: int,
    seq: int,
    cp: int,
    tp: int,
    bytes_per_element: float,
    style: str = "ulysses",
) -> Optional[list]:
    """The planner's attention exchange per step for `network` under cp (`style`: Ulysses' all-to-alls or the ring's
    all-gathers and all-to-alls; one attention per block of `block_lists`, as ``find_block_lists`` gives them; those
    full AC checkpoints repeat their forward exchanges); None when the attention's shape is unknown. ``seq``: the whole
    sequence. Shared by the ledger's plan and the dry run's."""
    from lightning_dist import planner

    shape = attention_shape(network)
    if shape is None:
        return None
    blocks = [block for _, blocks in block_lists for block in blocks]
    return planner.cp_attention_traffic(
        batch=batch,
        seq=seq,
        heads=shape[0],
        kv_heads=shape[1],
        head_dim=shape[2],
        attention_calls=len(blocks),
        recomputed_calls=sum(1 for block in blocks if recomputes_attention(block)),
        cp=cp,
        tp=tp,
        bytes_per_element=bytes_per_element,
        style=style,
    )


def cp_model_problems(network: nn.Module, *, cp: int, tp: int = 1, style: str = "ulysses") -> list[str]:
    """What makes `network` unsplittable over `cp` ranks (with `tp`-way head sharding inside), as messages. The ring
    (`style`) keeps every head on every rank: only Ulysses needs the heads to divide by cp."""
    problems = []
    heads = attention_heads(network)
    if style == "ulysses" and isinstance(heads, int) and heads % (cp * tp):
        local = f" per tensor-parallel rank ({heads} / tp={tp})" if tp > 1 else ""
        problems.append(
            f"{heads} attention heads{local} do not divide over cp={cp}: Ulysses context parallelism gives each cp"
            f" rank whole heads. Pick cp dividing {heads // tp if tp > 1 and heads % tp == 0 else heads}, or"
            " cp_style='ring' (every rank keeps every head)."
        )
    if any(isinstance(m, nn.MultiheadAttention) for m in network.modules()):
        problems.append(
            f"{type(network).__name__} uses nn.MultiheadAttention, whose attention runs inside"
            " F.multi_head_attention_forward where context parallelism cannot split it. Use a module calling"
            " F.scaled_dot_product_attention (HF models, the pack's GPT), or cp=1."
        )
    config = getattr(network, "config", None)
    if hasattr(config, "get_text_config"):  # a multimodal model's attention layers are its text config's
        config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        problems.append(
            f"{type(network).__name__} has attention layers other than full causal attention"
            f" ({sorted(set(layer_types)) or 'use_sliding_window=True'}: sliding windows, chunks, linear or recurrent"
            " attention, convolutions over the sequence); context parallelism splits full causal attention only."
            " Use cp=1 for this model."
        )
    params = inspect.signature(network.forward).parameters
    if "position_ids" not in params:
        problems.append(
            f"{type(network).__name__}.forward takes no `position_ids`: context parallelism gives each rank a part"
            " of every sequence, and a model that numbers its positions from 0 itself would see the wrong ones."
            " Add a `position_ids=None` argument that the positional embedding uses (HF models and the pack's GPT"
            " have it), or use cp=1."
        )
    return problems


def find_network(module: nn.Module, name: str = "auto") -> nn.Module:
    """The network the LightningModule calls with the token ids: attribute `name`, or ``"auto"``: ``model``, else
    its one child module."""
    if name != "auto":
        net = getattr(module, name, None)
        if not isinstance(net, nn.Module):
            raise ValueError(f"`cp_network={name!r}` is not a module attribute of {type(module).__name__}.")
        return net
    net = getattr(module, "model", None)
    if isinstance(net, nn.Module):
        return net
    children = list(module.children())
    if len(children) == 1:
        return children[0]
    raise ValueError(
        f"Context parallelism hooks the network {type(module).__name__} calls with the token ids, and found"
        f" {len(children)} child modules and no `model` attribute: pass cp_network='<attribute name>'."
    )


@dataclass
class CPGroup:
    """The cp process group this rank is in: ``size``, ``rank``, ``group``, and how attention is exchanged over it
    (``style``: ``"ulysses"`` or ``"ring"``)."""

    size: int
    rank: int
    group: Any
    dp_group: Any = None
    """The data-parallel group (HF ``labels=``: the labelled tokens are counted over it, for the token mean)."""
    dp_size: int = 1
    style: str = "ulysses"
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Index tensors per (what, length, device): every step and every attention layer asks for the same few."""

    def labelled_tokens(self, shifted: Tensor) -> Tensor:
        """The labelled tokens (``!= -100``) of the whole shifted labels, as the mean over the dp ranks' batches
        (float32; one all-reduce over dp when dp > 1): each rank divides its sum by the same count, so the dp mean of
        the ranks' losses is the global batch's token mean. Every cp rank calls it with the whole sequences."""
        count = (shifted != -100).sum().to(torch.float32)
        if self.dp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(count, group=self.dp_group)
            count = count / self.dp_size
        return count

    def positions(self, seq_len: int, device: Any) -> Tensor:
        """The token positions this rank holds, in its local order (int64 ``[seq_len / cp]``)."""
        key = ("positions", seq_len, str(device))
        if key not in self._cache:
            chunks = cp_chunks(seq_len, self.size, self.rank)  # raises ValueError naming the fix for bad lengths
            self._cache[key] = torch.cat([torch.arange(a, b, device=device) for a, b in chunks])
        return self._cache[key]

    def gathered_order(self, local_len: int, device: Any) -> tuple[Tensor, Tensor]:
        """For the sequence as the all-to-all gathers it (rank 0's chunks, rank 1's, ...): each entry's position,
        and its inverse (the gathered index of each position)."""
        key = ("gathered", local_len, str(device))
        if key not in self._cache:
            seq_len = local_len * self.size
            order = torch.cat(
                [
                    torch.arange(a, b, device=device)
                    for r in range(self.size)
                    for a, b in cp_chunks(seq_len, self.size, r)
                ]
            )
            self._cache[key] = (order, torch.argsort(order))
        return self._cache[key]


def _seq_to_heads(t: Tensor, cp: CPGroup) -> Tensor:
    """``[B, H, S/cp, D]`` (this rank's tokens, all heads) -> ``[B, H/cp, S, D]`` (this rank's heads, all tokens)."""
    B, H, S_local, D = t.shape
    send = t.reshape(B, cp.size, H // cp.size, S_local, D).transpose(0, 1).contiguous()  # [cp, B, H/cp, S/cp, D]
    recv = all_to_all_autograd(send, cp.group)  # recv[j]: rank j's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // cp.size, cp.size * S_local, D)


def _heads_to_seq(t: Tensor, cp: CPGroup) -> Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    B, H_local, S, D = t.shape
    S_local = S // cp.size
    send = t.reshape(B, H_local, cp.size, S_local, D).permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, H/cp, S/cp, D]
    recv = all_to_all_autograd(send, cp.group)  # recv[j]: my tokens of rank j's heads
    return recv.transpose(0, 1).reshape(B, cp.size * H_local, S_local, D)


def _refuse_mask(kwargs: dict) -> None:
    """Both exchanges take whole-sequence causal (or unmasked) attention only: a mask built for one rank's part of the
    sequence cannot be split."""
    if kwargs.get("attn_mask") is not None:
        raise RuntimeError(
            "Context parallelism got an explicit `attn_mask` for scaled_dot_product_attention: it is built for one"
            " rank's part of the sequence and cannot be split here. Use is_causal=True (or no mask), or cp=1."
        )


def ulysses_sdpa(cp: CPGroup, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` on sequence shards, exact: all-to-all to head shards, attention over the
    whole sequence in natural order, all-to-all back."""
    _refuse_mask(kwargs)
    if q.dim() != 4 or q.shape[1] % cp.size or q.shape[1] % k.shape[1]:
        raise RuntimeError(
            f"Context parallelism needs [batch, heads, seq, dim] attention inputs whose heads divide by cp={cp.size};"
            f" got q {tuple(q.shape)}, k {tuple(k.shape)}. Pick cp dividing the heads, or cp=1."
        )
    if k.shape[1] % cp.size:  # grouped-query attention with fewer key/value heads than cp: one per query head
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        kwargs["enable_gqa"] = False
    order, to_natural = cp.gathered_order(q.shape[2], q.device)
    q, k, v = (_seq_to_heads(t, cp).index_select(2, to_natural) for t in (q, k, v))
    out = _SDPA(q, k, v, **kwargs)
    return _heads_to_seq(out.index_select(2, order), cp)


def ring_sdpa(cp: CPGroup, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` on sequence shards through torch's ring attention, exact: this rank keeps its
    queries and every head; the key/value chunks go round the cp ranks (torch's rotation, an all-gather by default) and
    the partial results merge by their log-sum-exp. The chunks are the load-balanced head and tail ones, torch's
    order, so each rank does the same causal work. Key/value heads fewer than the query heads are repeated first (the
    kernels take equal heads)."""
    from lightning_dist._integrations.torch_ring_attention import ring_attention

    _refuse_mask(kwargs)
    if kwargs.get("dropout_p", 0.0):
        raise RuntimeError(
            f"cp_style='ring' runs attention without dropout; the model asked for dropout_p={kwargs['dropout_p']}."
            " Set the attention dropout to 0, or use cp_style='ulysses'."
        )
    if q.dim() != 4 or q.shape[1] % k.shape[1]:
        raise RuntimeError(
            f"Context parallelism needs [batch, heads, seq, dim] attention inputs (query heads a multiple of the"
            f" key/value heads); got q {tuple(q.shape)}, k {tuple(k.shape)}."
        )
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return ring_attention(
        q, k, v, group=cp.group, is_causal=bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale")
    )


# losses that compare an output with a target token by token: (input, target) first, class dim 1 for the first two
_TOKEN_LOSSES = {
    F.cross_entropy: True,
    F.nll_loss: True,
    F.mse_loss: False,
    F.l1_loss: False,
    F.smooth_l1_loss: False,
    F.binary_cross_entropy: False,
    F.binary_cross_entropy_with_logits: False,
}


def loss_split_problem(func: Any, args: tuple, kwargs: dict, cp: int) -> Optional[str]:
    """Why a token loss called under cp compares this rank's part of the sequences with a whole target (None: it
    does not). Seen as the input holding 1/cp of the target's tokens, where torch would fail with a bare shape
    error ("Expected input batch_size (64) to match target batch_size (128)")."""
    values = dict(zip(("input", "target"), args))
    values.update({k: v for k, v in kwargs.items() if k in ("input", "target")})
    x, y = values.get("input"), values.get("target")
    if not (isinstance(x, Tensor) and isinstance(y, Tensor)) or x.dim() == 0:
        return None
    if _TOKEN_LOSSES[func]:  # [N, C, ...] against class ids [N, ...] or probabilities [N, C, ...]
        classes = x.shape[1] if x.dim() >= 2 else x.shape[0]
        got, want = x.numel() // max(classes, 1), y.numel() if y.dim() < x.dim() else y.numel() // max(classes, 1)
    else:
        got, want = x.numel(), y.numel()
    if got == want or got * cp != want:
        return None
    return (
        f"{func.__name__} got an input of shape {tuple(x.shape)} and a target of shape {tuple(y.shape)}: under"
        f" context parallelism (cp={cp}) the network returns this rank's part of each sequence (1/{cp} of its"
        " tokens) and the target is whole. Compute the loss in the LightningModule's"
        " `pipeline_loss(self, output, target)` and call `loss = self.pipeline_loss(logits, target)` in"
        " training_step: the strategy hands it the target's chunks that match (a HuggingFace model: pass"
        " `labels=` and use `out.loss`). Or use cp=1."
    )


class ContextParallelAttention(TorchFunctionMode):
    """Routes every ``F.scaled_dot_product_attention`` call made while active through context parallelism's exchange:
    :func:`ulysses_sdpa`, or :func:`ring_sdpa` when the group's ``style`` is ``"ring"``. A token loss (cross-entropy,
    MSE...) comparing this rank's part of the sequences with a whole target is refused naming the fix
    (:func:`loss_split_problem`): every cp rank holds the same shapes, so all of them raise at that line, before the
    step's backward."""

    def __init__(self, cp: CPGroup) -> None:
        super().__init__()
        self.cp = cp
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _TOKEN_LOSSES:
            problem = loss_split_problem(func, args, kwargs, self.cp.size)
            if problem is not None:
                raise ValueError(problem)
        if func is _SDPA:
            self.calls += 1
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            kwargs = {**dict(zip(names, rest)), **kwargs}
            exchange = ring_sdpa if self.cp.style == "ring" else ulysses_sdpa
            return exchange(self.cp, q, k, v, **kwargs)
        return func(*args, **kwargs)


@dataclass
class _Call:
    """The network's last call under cp: full and local sequence lengths and this rank's positions."""

    seq_len: int
    positions: Tensor


class ContextParallel:
    """The cp state of one strategy: the hooked network, its group, the attention mode, the last call's split."""

    def __init__(self, cp: CPGroup) -> None:
        self.cp = cp
        self.network: Optional[nn.Module] = None
        self.last: Optional[_Call] = None
        self.calls = 0  # attention calls served by the exchange so far (the split really ran)
        self._handle: Any = None
        self._hf = False
        self._names: list[str] = []
        self._hf_attention: Optional[str] = None  # the HF model's own attention implementation, restored on detach
        self._off = False  # inside `unsplit`: the network runs on whole sequences

    # ---- the step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Attention calls inside go through the exchange (the step; and each recomputation of a checkpointed block)."""
        if self._off:  # the unsplit reference pass: its checkpointed blocks recompute without the exchange too
            yield
            return
        mode = ContextParallelAttention(self.cp)
        try:
            with mode:
                yield
        finally:
            self.calls += mode.calls

    @contextlib.contextmanager
    def unsplit(self) -> Iterator[None]:
        """Inside, the network runs as without cp: the hook passes its inputs through and :meth:`active` holds no
        mode (the self-check's reference pass on the real, sharded model: :mod:`.cp_probe`)."""
        self._off = True
        try:
            yield
        finally:
            self._off = False

    def split_target(self, output: Any, target: Any) -> Optional[Tensor]:
        """`target`'s chunks when `output` comes from the last network call (seq dim local) and `target` is whole."""
        call = self.last
        if (
            call is not None
            and isinstance(output, Tensor)
            and isinstance(target, Tensor)
            and output.dim() >= 2
            and target.dim() >= 2
            and output.shape[1] == len(call.positions)
            and target.shape[1] == call.seq_len
        ):
            return target.index_select(1, call.positions.to(target.device))
        return None

    # ---- the network's inputs ------------------------------------------------------------------
    def attach(self, network: nn.Module, *, hook: bool = True) -> None:
        """Hook `network` so each call sees this rank's chunks (see the module doc); once per network.

        ``hook=False`` (a pipeline, whose schedule calls the stages with inputs :meth:`split_sequences` cut):
        only the network's attention set-up (HF models: :func:`_use_hf_attention`), undone by :meth:`detach`."""
        if self._handle is not None or self.network is network:
            return
        self.network = network
        self._names = list(inspect.signature(network.forward).parameters)  # once: the hook binds each call to them
        self._hf = _is_hf(network)
        if self._hf:
            self._hf_attention = _use_hf_attention(network, self.cp.size)
        if hook:
            self._handle = network.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True)
        log.info("context parallelism: %s split over cp=%d (%s)", type(network).__name__, self.cp.size, self.cp.style)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._hf_attention is not None and self.network is not None:
            self.network.set_attn_implementation(self._hf_attention)
            self._hf_attention = None
        self.network = None

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if self._off:
            return None  # the inputs as given
        bound = dict(zip(self._names, args))
        bound.update(kwargs)
        lead = bound.get("input_ids", bound.get("inputs_embeds"))
        if lead is None:
            lead = next((a for a in args if isinstance(a, Tensor)), None)
        if not isinstance(lead, Tensor) or lead.dim() < 2:
            raise RuntimeError(
                f"Context parallelism splits the sequence dim (1) of the token ids {type(module).__name__} is called"
                f" with; found no [batch, seq] tensor among its arguments {sorted(bound)}."
            )
        labels = bound.get("labels")
        if self._hf and isinstance(labels, Tensor):
            shifted = bound.pop("shift_labels", None)
            if shifted is None:
                shifted = shift_labels(labels)
            bound["shift_labels"] = shifted
            count = bound.pop("num_items_in_batch", None)
            if count is None:  # the tokens of the whole sequences (every cp rank holds them here, before the split)
                count = self.cp.labelled_tokens(shifted)
            # FSDP averages gradients over dp x cp: each rank's sum over `count / cp` tokens, so that the mean of the
            # ranks' losses (and gradients) is the whole global batch's token mean
            bound["num_items_in_batch"] = count / self.cp.size
        return (), self.split_sequences(lead, bound)

    def split_sequences(self, lead: Tensor, values: dict) -> dict:
        """`values` with every ``[B, S, ...]`` tensor (S: `lead`'s dim 1) cut to this rank's chunks, an all-ones
        ``attention_mask`` dropped (padding refused) and ``position_ids`` added when absent; recorded as the last
        call (:meth:`split_target`). The network's hook uses it, and the pipeline for its micro-batches' inputs."""
        values = dict(values)
        seq_len = lead.shape[1]
        given = values.get("position_ids")
        if self._hf and isinstance(given, Tensor) and bool((given.diff(dim=-1) != 1).any()):
            raise ValueError(
                "Context parallelism got `position_ids` that restart or jump inside a row (packed sequences):"
                " transformers then keeps attention inside each packed sequence (when no cache is used), and context"
                " parallelism runs one causal attention over the whole row. Pass one sequence per row (no"
                " `position_ids`, or 0, 1, 2, ... per row), or use cp=1."
            )
        positions = self.cp.positions(seq_len, lead.device)  # raises ValueError naming the fix for bad lengths
        mask = values.pop("attention_mask", None)
        if mask is not None and not bool(torch.all(mask != 0)):
            raise ValueError(
                "Context parallelism got an attention_mask with padding (zeros): padded batches are not supported"
                " under cp yet. Pack the sequences to full length (no padding), or use cp=1."
            )
        for key, value in list(values.items()):
            if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
                values[key] = value.index_select(1, positions.to(value.device))
        if values.get("position_ids") is None:
            values["position_ids"] = positions.unsqueeze(0).expand(lead.shape[0], -1)
        self.last = _Call(seq_len=seq_len, positions=positions)
        return values


def shift_labels(labels: Tensor) -> Tensor:
    """HF's causal-LM shift, done before the split: position i holds the label of token i + 1 (-100 at the end), so
    the last token of a chunk predicts the first of the next (held by another rank)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)


def _is_hf(network: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(network, tf.PreTrainedModel)


def _use_hf_attention(network: nn.Module, cp: int) -> str:
    """HF models: attention through transformers' own SDPA function under a name of the pack's, whose mask builder
    (:func:`_no_mask`) returns None (its packed-sequence detection would read the split positions as several
    sequences); SDPA then gets ``is_causal`` and :class:`ContextParallelAttention` exchanges the whole sequence."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(HF_ATTENTION, functools.partial(_no_mask, cp=cp))
    own = network.config._attn_implementation
    if own not in ("sdpa", "eager", HF_ATTENTION):
        raise ValueError(
            f"{type(network).__name__} uses attn_implementation={own!r}; context parallelism runs HF models through"
            " SDPA. Load the model with attn_implementation='sdpa' (or 'eager'), or use cp=1."
        )
    if not _compat.hf_mask_builder_reports_mask():
        raise ValueError(
            f"{type(network).__name__}: this transformers release's mask builder does not report what"
            " lightning-dist reads to refuse a mask that context parallelism would drop (`q_length`, `local_size`,"
            " `use_vmap`: a window shorter than the sequence, the model's own mask terms). Use transformers 5.x,"
            " or cp=1."
        )
    network.set_attn_implementation(HF_ATTENTION)
    return own


def _no_mask(
    *args: Any, cp: int, q_length: int = 0, local_size: Optional[int] = None, use_vmap: bool = False, **kwargs: Any
) -> None:
    """HF's attention-mask builder under cp (it sees this rank's `q_length` tokens): no mask. What would go with the
    mask is refused, alike on every rank: a sliding window (`local_size`) shorter than the whole sequence, and the
    model's own mask terms (transformers composes them into the mask function and sets `use_vmap`)."""
    if use_vmap:
        raise ValueError(
            "The model adds its own terms to the causal attention mask (transformers' `or_mask_function` or"
            " `and_mask_function`: bidirectional spans such as image tokens, or a window of its own); context"
            " parallelism runs one causal (or full) attention over the whole sequence and would drop them (a"
            " different model). Use cp=1 for this model."
        )
    # a window mask that no layer uses (Qwen2-MoE builds one whatever its `layer_types`, all full attention here:
    # setup refuses any other) changes nothing
    layer_types = getattr(kwargs.get("config"), "layer_types", None) or ()
    unused = bool(layer_types) and all(t == "full_attention" for t in layer_types)
    if local_size is not None and local_size < q_length * cp and not unused:
        raise ValueError(
            f"The model's attention keeps a sliding window of {local_size} tokens and the sequences have"
            f" {q_length * cp}: context parallelism runs full causal attention, which would attend past the window (a"
            f" different model). Train on sequences of at most {local_size} tokens, or use cp=1 for this model."
        )
    return None


def apply_cp(model: nn.Module, state: ContextParallel, *, network: str = "auto") -> nn.Module:
    """Hook the network of `model` (a LightningModule) so that each call sees this rank's chunks of the sequence."""
    net = find_network(model, network)
    state.attach(net)
    return net


__all__ = [
    "CP_STYLES",
    "CPGroup",
    "ContextParallel",
    "ContextParallelAttention",
    "apply_cp",
    "cp_model_problems",
    "cp_style_problems",
    "find_network",
    "attention_heads",
    "loss_split_problem",
    "attention_shape",
    "planned_attention_traffic",
    "recomputes_attention",
    "ring_sdpa",
    "shift_labels",
    "ulysses_sdpa",
]
