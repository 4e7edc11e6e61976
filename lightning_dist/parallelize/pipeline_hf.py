"""Pipeline stages of an unmodified HuggingFace causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``...).

A stage is the model with the parts it does not own taken out, as torchtitan builds its stages, so the
model's own ``forward`` runs each stage (rotary embeddings, the causal mask from ``attention_mask``,
``position_ids``, grouped-query attention: whatever the model does). Where the parts are:

* the **block list**: the ``nn.ModuleList`` of ``config.base_model_pp_plan`` (``layers``), or of the base
  model's conventional block-list name (``h``: GPT-2 has no pp plan); a stage keeps its slice of it under the
  original indices (``model.layers.5`` stays ``model.layers.5``);
* the **stem** (first stage): the base model's children registered before the block list (embeddings,
  dropout). A later stage gets its input as ``inputs_embeds`` (every HF causal LM takes them in place of
  ``input_ids``); a stem part it does not own becomes :class:`Absent`, which adds nothing (an absolute
  position embedding) and passes hidden states through (an embedding dropout);
* the **head** (last stage): the base model's children after the block list (the final norm) and the
  LM's own children (``lm_head``); a stage that does not own them has ``nn.Identity`` there, so the
  ``logits`` it returns are its hidden states.

:func:`check_hf_stages` runs the stages one after the other on one micro-batch against the whole model
before anything is split: a model whose forward does not tolerate this is refused, never mis-trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dist.parallelize.units import BLOCK_LIST_NAMES


def is_hf_causal_lm(net: nn.Module) -> bool:
    """A HuggingFace ``PreTrainedModel`` with a base model and a config (what :func:`hf_layout` reads)."""
    config = getattr(net, "config", None)
    return (config is not None and hasattr(type(config), "base_model_pp_plan") and hasattr(net, "base_model")
            and hasattr(net, "get_output_embeddings"))


def hf_parts(net: nn.Module) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """``(base, block_list, stem, head)`` as qualified child names of `net`; TypeError naming what is missing."""
    base = net.base_model
    prefix = next((n for n, m in net.named_children() if m is base), None)
    if prefix is None:
        raise TypeError(f"{type(net).__name__}: its base model is not a direct child; cannot find the stages' parts.")
    plan = dict(getattr(net.config, "base_model_pp_plan", None) or {})
    lists = [n for n in plan if isinstance(getattr(base, n, None), nn.ModuleList)]
    if not lists:  # GPT-2 & co. have no pp plan: the conventional block-list names
        lists = [n for n in BLOCK_LIST_NAMES if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise TypeError(
            f"Cannot split {type(net).__name__} into pipeline stages: its base model has "
            f"{'no' if not lists else len(lists)} block list (config.base_model_pp_plan: {sorted(plan) or 'none'})."
        )
    names = list(base._modules)
    i = names.index(lists[0])
    stem = tuple(f"{prefix}.{n}" for n in names[:i] if base._modules[n] is not None)
    head = tuple(f"{prefix}.{n}" for n in names[i + 1:] if base._modules[n] is not None and _has_state(base._modules[n]))
    head += tuple(n for n, m in net.named_children() if m is not base and m is not None)
    return prefix, f"{prefix}.{lists[0]}", stem, head


def _has_state(module: nn.Module) -> bool:
    # parameter-free helpers after the blocks (rotary embeddings registered late) run on every stage
    return any(True for _ in module.parameters())


class Absent(nn.Module):
    """A stem part a later stage does not own: adds nothing to an embedding sum, passes hidden states through."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x  # e.g. the embedding dropout: the first stage applied it
        return torch.zeros((), dtype=torch.get_default_dtype())  # e.g. wpe(position_ids): x + 0 is x exactly


def _shallow(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A new module object sharing `module`'s parameters, buffers, children and attributes, with its own
    hook and child dicts (FSDP2 and PipelineStage register hooks on a stage: they must not reach the others)."""
    out = (cls or type(module)).__new__(cls or type(module))
    nn.Module.__init__(out)
    fresh = set(out.__dict__)
    out.__dict__.update({k: v for k, v in module.__dict__.items() if k not in fresh})
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    out._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    out._modules = dict(module._modules)
    out.training = module.training
    return out


class HFStageMixin(nn.Module):
    """Forward of a pipeline stage of a HF causal LM: ids (first stage) or hidden states in, logits or hidden out."""

    _ld_first: bool = True
    _ld_block_list: str | None = None
    runner: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self.runner is not None:  # the LightningModule's copy: the call runs the whole schedule
            return self.runner(*args, **kwargs)
        return self.run_local(*args, **kwargs)

    def run_local(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        key = "input_ids" if self._ld_first else "inputs_embeds"
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return super().forward(**{key: x}, **kwargs, use_cache=False).logits


def build_hf_stage(net: nn.Module, parts: tuple, blocks: Sequence[str], *, first: bool, last: bool) -> nn.Module:
    """`net` with only `blocks` of its block list, its stem when `first` and its head when `last` (shared modules)."""
    prefix, block_list, stem, head = parts
    cls = type(f"{type(net).__name__}Stage", (HFStageMixin, type(net)), {})
    lm = _shallow(net, cls)
    lm._ld_first = first
    lm._ld_block_list = block_list
    base = _shallow(net.get_submodule(prefix))
    lm._modules[prefix] = base
    full = net.get_submodule(block_list)
    kept = nn.ModuleList()
    kept._modules = {k: full._modules[k] for k in blocks}  # original indices: the single-device names
    base._modules[block_list.split(".", 1)[1]] = kept
    for name in stem if not first else ():
        base._modules[name.split(".", 1)[1]] = Absent()
    for name in head if not last else ():
        owner, _, child = name.rpartition(".")
        (base if owner == prefix else lm)._modules[child] = nn.Identity()
    if hasattr(lm, "_tied_weights_keys"):  # the pruned copy never re-ties (the tie lives in the parameters)
        lm.__dict__["_tied_weights_keys"] = None
    return lm


def model_class_copy(module: nn.Module) -> nn.Module:
    """`module` with every HF stage in it (itself included) turned back into the model's own class (shared
    parts): the stage classes are made per model at run time, so a stage cannot be pickled (e.g. gathered
    with ``all_gather_object``) as it is."""
    def plain(m: nn.Module) -> nn.Module:
        return _shallow(m, type(m).__mro__[2]) if isinstance(m, HFStageMixin) else m

    module = plain(module)
    for m in [module, *module.modules()]:
        for name, child in list(m._modules.items()):
            if isinstance(child, HFStageMixin):
                m._modules[name] = plain(child)
    return module


def check_hf_stages(net: nn.Module, stages: Sequence[nn.Module], sample: dict[str, torch.Tensor]) -> str | None:
    """Why running `stages` one after the other does not give ``net(**sample).logits`` (None when it does)."""
    was = net.training
    net.eval()
    for s in stages:
        s.eval()
    try:
        with torch.no_grad():
            expected = net(**sample, use_cache=False).logits
            x, kw = sample["input_ids"], {k: v for k, v in sample.items() if k != "input_ids"}
            for stage in stages:
                x = stage.run_local(x, **kw)
    except Exception as err:  # a forward that cannot run without the parts a stage does not own
        return f"its forward fails on a stage without the parts it does not own ({type(err).__name__}: {err})"
    finally:
        net.train(was)
        for s in stages:
            s.train(was)
    if x.shape != expected.shape:
        return f"the stages return {tuple(x.shape)}, the model {tuple(expected.shape)}"
    gap = (x - expected).abs().max().item()
    if not torch.allclose(x, expected, rtol=1e-5, atol=1e-6):
        return f"the stages compute another function (max abs difference {gap:.3g} on one micro-batch)"
    return None


def hf_example_inputs(net: nn.Module, *, batch: int = 2, seq: int | None = None) -> dict[str, torch.Tensor]:
    """A micro-batch of token ids built from the config (for the stage check and ``split="balanced"``)."""
    config = net.config
    n_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 16
    seq = seq or min(16, int(n_pos))
    device = next(net.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(config.vocab_size), (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def profile_hf(net: nn.Module, layout: Any, sample: dict[str, torch.Tensor], *, repeats: int = 5
               ) -> tuple[float, list[float], float]:
    """Milliseconds of (stem, each block, head) in forward, inside the model's own forward (best of `repeats`).

    Blocks need the model's extra inputs (mask, rotary embeddings), so they are timed by hooks during
    ``net(**sample)``; the backward is taken as proportional to the forward (the split only needs ratios).
    """
    import time

    names = [*layout.stem, *(f"{layout.block_list}.{k}" for k in layout.blocks), *layout.head]
    best = [float("inf")] * len(names)
    starts: dict[int, float] = {}
    handles = []
    for i, name in enumerate(names):
        module = net.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter())))
        handles.append(module.register_forward_hook(
            lambda m, a, o, i=i: best.__setitem__(i, min(best[i], (time.perf_counter() - starts[i]) * 1e3))))
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):
                net(**sample, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    n_stem, n_head = len(layout.stem), len(layout.head)
    best = [0.0 if b == float("inf") else b for b in best]  # a part the forward never calls costs nothing
    return sum(best[:n_stem]), best[n_stem:len(best) - n_head], sum(best[len(best) - n_head:])


def hf_labels_loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any = None) -> torch.Tensor:
    """HF's causal-LM ``labels`` convention: next-token cross-entropy (labels shifted by one, -100 ignored).

    `num_items`: divide the summed loss by this instead of the count of labelled tokens: the pipeline divides
    each micro-batch by the whole batch's count, so the micro-batches' losses add up to the batch mean.
    Written out (not ``model.loss_function``) because HF's upcast ``logits.float()`` would *downcast* float64.
    """
    import torch.nn.functional as F

    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(logits.to(dtype).flatten(0, -2), shifted.flatten(), ignore_index=-100, reduction="sum")
    return loss / (labelled_tokens(labels) if num_items is None else num_items)


def pipeline_loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: Any = None,
                           num_items_in_batch: Any = None, **kwargs: Any) -> torch.Tensor:
    """HF's ``model.loss_function`` signature with the pipeline's loss math (:func:`hf_labels_loss`).

    For a single-device reference of a pipelined HF model (``GradientParityCheck``): set as the joined
    model's ``loss_function``, its ``labels`` loss is computed as the pipeline computes it, in the logits'
    dtype (HF's own ``ForCausalLMLoss`` casts float64 logits to float32, a difference of ~1e-7 that a
    float64 gradient check would report as a mismatch).
    """
    return hf_labels_loss(logits, labels, num_items=num_items_in_batch)


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many targets HF's causal-LM loss averages over: labels after the shift that are not -100."""
    return (labels[..., 1:] != -100).sum()


__all__ = ["Absent", "HFStageMixin", "build_hf_stage", "check_hf_stages", "hf_example_inputs", "hf_labels_loss",
           "hf_parts", "profile_hf", "is_hf_causal_lm", "labelled_tokens", "model_class_copy", "pipeline_loss_function"]
