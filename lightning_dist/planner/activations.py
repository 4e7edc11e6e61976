"""Peak activation bytes of a training step for the pack's pre-norm transformer blocks."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dist.planner._checks import check_count, check_size


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """Sizes of a pre-norm transformer block (the pack's GPT family) for :func:`activation_bytes`."""

    hidden: int
    """Model width ``C``."""
    heads: int
    """Attention heads ``h``."""
    mlp_hidden: int
    """MLP inner width ``H``."""
    vocab: int | None = None
    """Vocabulary size ``V`` of the output head (None: no head term)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``heads``."""

    @property
    def params(self) -> float:
        """Weights of one block: q and proj ``C^2`` each, k and v ``C C_kv`` each, fc1 and fc2 ``C H`` each."""
        C = self.hidden
        kv = C * (self.kv_heads or self.heads) / self.heads
        return 2 * C * C + 2 * C * kv + 2 * C * self.mlp_hidden


def _ac_mode(value: bool | str | object) -> tuple[str | None, int]:
    """(``"full"``/``"selective"``/None, N) of an ``activation_checkpointing=`` value."""
    if value is False or value is None:
        return None, 1
    if value == "selective":
        return "selective", 1
    if isinstance(value, str) and value.startswith("every:"):
        n = value[len("every:") :]
        if not (n.isascii() and n.isdigit()) or int(n) < 1:  # ASCII: str.isdigit() accepts '²', int() does not
            raise ValueError(f"checkpointed={value!r}: N in 'every:N' must be an integer >= 1.")
        return "full", int(n)
    if value is True or value == "full" or (isinstance(value, (list, tuple)) and value):
        return "full", 1
    raise ValueError(f"checkpointed={value!r} must be False, True/'full', 'selective', 'every:N' or class names.")


def check_checkpointed(value: bool | str | object) -> None:
    """Raise ``ValueError`` unless `value` is an ``activation_checkpointing=`` value :func:`activation_bytes` takes."""
    _ac_mode(value)


def activation_bytes(
    block: BlockShape,
    *,
    tokens: int,
    blocks: int,
    tp: int = 1,
    bytes_per_element: float = 2,
    residual_bytes: float | None = None,
    micro_batches_held: int = 1,
    stem: bool = True,
    head: bool = True,
    head_gathered: bool = False,
    checkpointed: bool | str = False,
    autocast: bool = False,
    offloaded: bool = False,
) -> float:
    """Peak activation bytes of one training step on one device (saved for backward + the backward's start).

    ``N = tokens`` per micro-batch on this device (batch x sequence), ``a`` = ``bytes_per_element`` (compute
    dtype), ``f`` = ``residual_bytes`` (the residual stream's dtype; default ``a``), ``t`` = ``tp``.
    Per pre-norm block (``norm1 -> q, k, v -> attention -> proj``, ``norm2 -> fc1 -> GELU -> fc2``), the
    tensors autograd keeps for backward, per token::

        norm inputs             2 f C              (norm1, norm2; + 2 x 8 B of mean / rstd)
        norm outputs            2 a C              (the q/k/v input and the fc1 input: replicated over tp)
        q, k, v, attention out  4 a C / t          (the attention kernel's saved inputs and output)
        proj input              a C / t
        GELU and fc2 inputs     2 a H / t
        log-sum-exp             4 h / t

    ``autocast`` (Lightning's ``*-mixed`` precision without FSDP2's cast of the parameters): each linear casts
    its input and its weight to the compute dtype itself and keeps both, so the q, k, v and fc1 inputs are
    four copies (``4 a C`` instead of ``2 a C``) and each block (and the head) keeps a compute-dtype copy of
    its tensor-parallel local weights per micro-batch (``a x params / t``, not per token).
    ``checkpointed`` (the ``activation_checkpointing=`` option of the strategies): ``True``/``"full"``: a block
    keeps only its input ``f C`` and one block's full set is live again while it is recomputed;
    ``"selective"`` (the default op list): a block keeps its input, every second matmul's output and the attention
    output ``f C + 3 a C / t + a H / t + 4 h / t`` (q, v and the attention output; fc1; k, proj and fc2 are
    recomputed), plus ``2 a C`` with ``tp > 1`` (the all-reduced proj and fc2 outputs: collectives are kept), and
    the rest of one block is live again while it is recomputed;
    ``"every:N"``: ``blocks // N`` blocks are checkpointed in full, the others keep their full set; block class
    names: as ``True``. ``offloaded`` (``offload_activations=True``): the uncheckpointed blocks' sets are in host
    memory, one of them on the device (the block being computed, or copied back in backward). The stem (``stem``) adds
    the embedding output ``a C`` (and the int64 token ids);
    the head (``head``) the final norm's input and output ``(f + a) C`` and, when backward starts, the
    cross-entropy's saved log-probabilities, their gradient and the logits' gradient in the loss dtype
    (``3 f V``; the loss runs in the residual dtype, float32 under autocast) plus the logits' gradient in
    the compute dtype (``a V`` when the head is ``colwise_gather`` across ``tp``, ``head_gathered``, else
    ``a V / t``); the logits themselves are not kept (no backward needs them). A pipeline stage holds
    ``micro_batches_held`` micro-batches at its peak (1F1B: ``p - s``); the head runs on one at a time.
    """
    for name, value in (("tokens", tokens), ("tp", tp), ("micro_batches_held", micro_batches_held)):
        check_size(name, value)
    check_count("blocks", blocks)
    a = bytes_per_element
    f = a if residual_bytes is None else residual_bytes
    C, H, h, t = block.hidden, block.mlp_hidden, block.heads, tp
    copies = 4 if autocast else 2  # compute-dtype inputs of q, k, v and fc1 (one shared norm output without autocast)
    full = 2 * f * C + 16 + copies * a * C + 4 * a * C / t + a * C / t + 2 * a * H / t + 4 * h / t
    mode, every = _ac_mode(checkpointed)
    # selective: q, v, the attention output and fc1 kept (k, proj and fc2 are the matmuls recomputed), and the
    # all-reduced proj and fc2 outputs when tensor parallel (collective outputs are kept)
    selective = f * C + 3 * a * C / t + a * H / t + 4 * h / t + (2 * a * C if t > 1 else 0)
    kept = {"full": f * C, "selective": selective}.get(mode, full)
    n_ckpt = blocks // every if mode else 0  # blocks N, 2N, ... are checkpointed
    kept_blocks = blocks - n_ckpt  # blocks that keep their full set (on the host when offloaded)
    saved = (min(kept_blocks, 1) if offloaded else kept_blocks) * full + n_ckpt * kept
    saved += full - kept + f * C if n_ckpt else 0  # one block recomputed (its input counted twice, as measured)
    if stem:
        saved += a * C + 8
    weights = (blocks * block.params / t) * a if autocast else 0.0  # per micro-batch, not per token
    total = micro_batches_held * (saved * tokens + weights)
    if head and block.vocab:
        V = block.vocab
        per_token = (f + a) * C + 16 + 3 * f * V + (a * V if head_gathered else a * V / t)
        total += per_token * tokens + (a * C * V / t if autocast else 0.0)
    return total
