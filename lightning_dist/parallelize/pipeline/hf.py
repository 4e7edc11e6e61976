"""Pipeline stages of an unmodified HuggingFace causal LM (Llama, Qwen2, GPT-2...): its parts, stage inputs and
``labels`` loss. Notes: docs/internals.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dist.parallelize.pipeline.pruned import PrunedStage
from lightning_dist.parallelize.units import BLOCK_LIST_NAMES


def is_hf_causal_lm(net: nn.Module) -> bool:
    """A HuggingFace ``PreTrainedModel`` with a base model and a config (what :func:`hf_parts` reads)."""
    config = getattr(net, "config", None)
    return (
        config is not None
        and hasattr(type(config), "base_model_pp_plan")
        and hasattr(net, "base_model")
        and hasattr(net, "get_output_embeddings")
    )


def hf_parts(net: nn.Module) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """``(base, block_list, stem, head)`` as qualified child names of `net`; TypeError naming what is missing."""
    plan = dict(getattr(net.config, "base_model_pp_plan", None) or {})

    def block_lists(base: nn.Module, plan: dict = plan) -> list[str]:  # GPT-2 & co. have no pp plan: the usual names
        lists = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
        return lists or [n for n in BLOCK_LIST_NAMES if isinstance(getattr(base, n, None), nn.ModuleList)]

    base = net.base_model
    if base is net:  # a prefix naming no child (Llama 4's `language_model` for `model`): the child with the blocks
        base = next((m for _, m in net.named_children() if block_lists(m)), net)
    prefix = next((n for n, m in net.named_children() if m is base), None)
    if prefix is None:
        raise TypeError(f"{type(net).__name__}: its base model is not a direct child; cannot find the stages' parts.")
    owner, holder, lists, before, after = prefix, base, block_lists(base), (), ()
    # a multimodal model's text model one level down (Gemma 3's `language_model`, with a pp plan of its own): its
    # blocks are the stages'; the base's other parts (a vision tower) go with the side of it they are registered on
    inner = [] if lists else [(n, m) for n, m in base.named_children() if block_lists(m, _pp_plan(m))]
    if len(inner) == 1 and hasattr(inner[0][1], "config"):
        holder, owner = inner[0][1], f"{prefix}.{inner[0][0]}"
        lists = block_lists(holder, _pp_plan(holder))
        children = [f"{prefix}.{n}" for n, m in base._modules.items() if m is not None]
        before, after = tuple(children[: children.index(owner)]), tuple(children[children.index(owner) + 1 :])
    if len(lists) != 1:
        raise TypeError(
            f"Cannot split {type(net).__name__} into pipeline stages: its base model has "
            f"{'no' if not lists else len(lists)} block list (config.base_model_pp_plan: {sorted(plan) or 'none'})."
        )
    names = [n for n, m in holder._modules.items() if m is not None]
    i = names.index(lists[0])
    stem = before + tuple(f"{owner}.{n}" for n in names[:i])
    # parameter-free helpers after the blocks (rotary embeddings registered late) run on every stage
    head = tuple(f"{owner}.{n}" for n in names[i + 1 :] if any(True for _ in holder._modules[n].parameters()))
    head += after + tuple(n for n, m in net.named_children() if m is not base)
    return owner, f"{owner}.{lists[0]}", stem, head


def _pp_plan(module: nn.Module) -> dict:
    return dict(getattr(getattr(module, "config", None), "base_model_pp_plan", None) or {})


class HFStageMixin(PrunedStage):
    """Forward of a pipeline stage of a HF causal LM: ids (first stage) or hidden states in, logits or hidden out."""

    _ld_embed_width: int | None = None
    """The whole model's input-embedding width (set at the split)."""

    def run_local(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        key = "input_ids" if self._ld_first else "inputs_embeds"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        # a stage without the head hands on its last block's output, never `.logits` (HF's full-slice view of the
        # hidden states, which torch's zero-bubble split backward cannot `detach_()` in place)
        forward = self._ld_model.forward
        return self._run_forward(
            x, lambda: forward(self, **{key: self._stage_input(x)}, **kwargs, use_cache=False).logits
        )

    def _stage_input(self, x: torch.Tensor) -> torch.Tensor:
        """The ids on the first stage; later, zeros in place of the input embeddings (the first block takes the
        activation), shaped as the embedding gives them: DeepSeek V4's blocks hand on several residual streams."""
        if self._ld_first:
            return x
        h, width = self._ld_handover, self._ld_embed_width
        return h.stand_in if width is None else h.zeros((*x.shape[:2], width))

    @staticmethod
    def whole_output(net: nn.Module, sample: Any) -> torch.Tensor:
        return net(**sample, use_cache=False).logits

    @staticmethod
    def split_sample(sample: Any) -> tuple[Any, dict[str, Any]]:
        return sample["input_ids"], {k: v for k, v in sample.items() if k != "input_ids"}


def hf_example_inputs(net: nn.Module) -> dict[str, torch.Tensor]:
    """A micro-batch of token ids, 1 x up to 16, made from the config (for the stage check and ``split="balanced"``).
    One row: a later stage's forward that unpacks a block's tuple (``h, state = block(...)``) from the activation's
    stand-in fails on it, where 2 rows would unpack by chance (see ``HFLayout.sample``)."""
    config = net.config.get_text_config() if hasattr(net.config, "get_text_config") else net.config  # multimodal
    n_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 16
    device = next(net.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(config.vocab_size), (1, min(16, int(n_pos))), generator=gen).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


HF_STAGE_INPUTS = frozenset({"attention_mask", "position_ids", "token_type_ids"})
"""Keyword inputs of a HF causal LM that every stage takes (split into micro-batches along dim 0)."""


def hf_call_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """(first stage's input, inputs every stage takes, ``labels``) of a call of a pipelined HF model."""
    kwargs = dict(kwargs)
    if len(args) > 1 or (args and "input_ids" in kwargs):
        raise TypeError("A pipelined HuggingFace model takes `input_ids` (positionally or by name) and keyword inputs.")
    x = args[0] if args else kwargs.pop("input_ids", None)
    labels = kwargs.pop("labels", None)
    for key in ("use_cache", "return_dict"):  # the stages never cache; the call returns a ModelOutput anyway
        kwargs.pop(key, None)
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in HF_STAGE_INPUTS)
    if not isinstance(x, torch.Tensor) or unknown:
        raise TypeError(
            f"A pipelined HuggingFace model takes `input_ids` (a tensor) and the keyword inputs"
            f" {sorted(HF_STAGE_INPUTS)} and `labels`; got {type(x).__name__} and {unknown or 'no others'}."
        )
    return x, {k: v for k, v in kwargs.items() if v is not None}, labels


def hf_call_output(shown: torch.Tensor, loss: Any, labels: Any, aux: Any = None, coef: float = 0.0) -> Any:
    """What the pipelined HF model's call returns: a ``CausalLMOutputWithPast`` with the ``labels`` loss and what
    the step sees of the logits; with the router loss `aux` (a mixture of experts), a ``MoeCausalLMOutputWithPast``
    whose loss adds ``coef * aux``, as the model's own forward does."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if aux is None:
        return CausalLMOutputWithPast(loss=None if labels is None else loss, logits=shown)
    return MoeCausalLMOutputWithPast(loss=None if labels is None else loss + coef * aux, aux_loss=aux, logits=shown)


def hf_labels_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any = None, shifted: bool = False
) -> torch.Tensor:
    """HF's causal-LM ``labels`` convention: next-token cross-entropy (labels shifted by one, -100 ignored).

    `num_items`: the divisor of the summed loss (the pipeline divides each micro-batch by the whole batch's count);
    ``shifted=True``: `labels` are shifted already (context parallelism). Written out: HF's upcast ``logits.float()``
    would *downcast* float64.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    targets = labels if shifted else F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(logits.to(dtype).flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")
    if num_items is None:
        num_items = (labels != -100).sum() if shifted else labelled_tokens(labels)
    return loss / num_items


def pipeline_loss_function(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: Any = None, num_items_in_batch: Any = None, **kwargs: Any
) -> torch.Tensor:
    """HF's ``model.loss_function`` signature with the pipeline's loss math (:func:`hf_labels_loss`), in the logits'
    dtype: the single-device reference of a pipelined HF model (HF's own casts float64 logits to float32)."""
    return hf_labels_loss(logits, labels, num_items=num_items_in_batch)


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many targets HF's causal-LM loss averages over: labels after the shift that are not -100."""
    return (labels[..., 1:] != -100).sum()


__all__ = [
    "HFStageMixin",
    "hf_call_inputs",
    "hf_call_output",
    "hf_example_inputs",
    "hf_labels_loss",
    "hf_parts",
    "is_hf_causal_lm",
    "labelled_tokens",
    "pipeline_loss_function",
]
