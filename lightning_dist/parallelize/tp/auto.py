"""Built-in tensor-parallel plans, and ``tp_plan="auto"``: the model's own plan, else its structure, else refuse.

Notes: docs/internals.md, "lightning_dist/parallelize/tp/auto.py"."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from lightning_dist.parallelize.shared import shared_parameters
from lightning_dist.parallelize.tp.vocab import (
    PlanValue,
    is_norm,
    linear_like,
    out_features,
    pattern_matches,
    plan_roots,
)
from lightning_dist.parallelize.units import find_block_lists

# HuggingFace style name (transformers.distributed.tensor_parallel) -> ours; styles HF has and we lack (packed,
# unit-head, MoE/expert, MLA and parameter-level styles) are refused by name (HF_REFUSED says why)
_ROWWISE_WHOLE_INPUT = {"style": "rowwise", "input": "replicate"}  # HF: input replicated, split on entry
HF_STYLES: dict[str, PlanValue] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "embedding_rowwise": "rowwise",
    "embedding_colwise": {"style": "colwise", "output": "replicate"},
    "rowwise_replicate": "rowwise",
    "rowwise_split_input": _ROWWISE_WHOLE_INPUT,
    "rowwise_rep": _ROWWISE_WHOLE_INPUT,
    "replicated_with_grad_allreduce": "replicate_grad_sum",
    "replicate": "replicate",
}
HF_REFUSED = {
    "packed_colwise": "a fused [gate | up] weight split per block with a strided shard",
    "packed_rowwise": "a fused weight split per block with a strided shard",
    "unit_colwise": "heads replicated over ranks when there are fewer heads than ranks",
    "unit_rowwise": "heads replicated over ranks when there are fewer heads than ranks",
    "mla_kv_a_proj": "multi-head latent attention's rotary part summed over ranks",
    "moe_tp_experts": "experts split inside each expert (deprecated by transformers)",
    "grouped_gemm": "expert parallelism (an ep plan)",
    "ep_dispatch_experts": "expert parallelism (an ep plan)",
    "local_params": "a module run with its own sharded parameters as local tensors",
    "all_reduce": "a module whose output is a partial sum",
    "sequence_parallel": "norms on sequence shards (the pack's sequence_parallel=True inserts its own)",
}

# (column-wise names, row-wise names) of an attention region; fused names must be head-major
ATTENTION_LAYOUTS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("q_proj", "k_proj", "v_proj"), ("o_proj", "out_proj", "dense")),
    (("q", "k", "v"), ("o", "proj", "out_proj", "dense", "c_proj")),
    (("query", "key", "value"), ("dense", "out", "o", "out_proj")),
    (("query_key_value",), ("dense", "proj", "o_proj", "out_proj")),
    (("qkv",), ("proj", "o", "out_proj", "o_proj", "dense")),
    (("Wqkv",), ("out_proj", "Wo")),
    (("c_attn",), ("c_proj",)),  # GPT-2: [q | k | v] blocks, split per head (colwise_qkv; see _blocked_qkv)
)
MLP_LAYOUTS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("fc1",), ("fc2",)),
    (("gate_proj", "up_proj"), ("down_proj",)),
    (("up_proj",), ("down_proj",)),
    (("c_fc",), ("c_proj",)),
    (("fc_1", "fc_2"), ("proj",)),  # litgpt LLaMAMLP
    (("fc",), ("proj",)),  # litgpt GptNeoxMLP
    (("dense_h_to_4h",), ("dense_4h_to_h",)),
    (("w1", "w3"), ("w2",)),
    (("fc_in",), ("fc_out",)),
    (("linear1",), ("linear2",)),  # nn.TransformerEncoderLayer / DecoderLayer
)
FUSED_QKV = ("qkv", "query_key_value", "Wqkv")
"""Fused projections split as-is: their output must be head-major (each head's q, k, v together)."""
BLOCKED_QKV = ("c_attn",)
"""Fused projections laid out ``[q | k | v]``: split per head (``colwise_qkv``), never contiguously."""


def _blocked_qkv(attn: nn.Module, name: str) -> bool:
    """True when `attn.<name>` is a self-attention's fused [q | k | v] projection: three blocks of its width."""
    out = out_features(getattr(attn, name, None))
    width = next(
        (getattr(attn, a) for a in ("split_size", "embed_dim") if isinstance(getattr(attn, a, None), int)), None
    )
    return isinstance(out, int) and width is not None and out == 3 * width


def _config_qkv(attn: nn.Module, name: str) -> str | None:
    """litgpt's fused qkv: ``[q | k | v]`` of widths ``(n_head, n_query_groups, n_query_groups) * head_size``,
    the counts read from ``attn.config``. "mha" (three equal blocks: colwise_qkv splits it per head), "gqa"
    (unequal blocks: no style of ours splits it exactly), or None (not this layout)."""
    cfg, layer = attn.__dict__.get("config"), getattr(attn, name, None)
    counts = [getattr(cfg, a, None) for a in ("n_head", "n_query_groups", "head_size")]
    out = getattr(layer, "out_features", None)
    if not all(isinstance(c, int) for c in counts) or not isinstance(out, int):
        return None
    nh, ng, hs = counts
    if out != (nh + 2 * ng) * hs:
        return None
    return "mha" if ng == nh else "gqa"


def _lin(module: nn.Module | None, name: str) -> bool:
    return linear_like(getattr(module, name, None))


def _region(module: nn.Module, layouts) -> tuple[tuple[str, ...], str] | None:
    for cols, rows in layouts:
        if any(c in BLOCKED_QKV for c in cols) and not all(_blocked_qkv(module, c) for c in cols):
            continue  # not three blocks of the attention's width (a cross-attention's k/v): stays whole
        if all(_lin(module, c) for c in cols):
            gqa = [c for c in cols if c in FUSED_QKV and _config_qkv(module, c) == "gqa"]
            if gqa:
                cfg = module.config
                raise ValueError(
                    f"{type(module).__name__}.{gqa[0]} is a fused [q | k | v] projection with n_head={cfg.n_head} and"
                    f" n_query_groups={cfg.n_query_groups} (config.n_query_groups, grouped-query attention): its q and"
                    " k/v blocks have unequal widths, which plan='auto' cannot split per head exactly (colwise_qkv"
                    " needs three equal blocks, a plain colwise split mixes q with k). Use n_query_groups == n_head,"
                    " or pass a plan that leaves the attention replicated and splits the MLP and the head."
                )
            row = next((r for r in rows if _lin(module, r)), None)
            if row is not None:
                return cols, row
    return None


def _sequential_mlp(module: nn.Module) -> bool:
    # Linear, parameter-free element-wise modules, Linear
    if not isinstance(module, nn.Sequential) or len(module) < 3:
        return False
    kids = list(module)
    return (
        isinstance(kids[0], nn.Linear)
        and isinstance(kids[-1], nn.Linear)
        and not any(any(True for _ in k.parameters()) for k in kids[1:-1])
    )


def _block_plan(block: nn.Module) -> tuple[dict[str, str], list[str]]:
    """Plan entries (relative to the block) for its attention and MLP regions, and notes on what stays whole."""
    plan: dict[str, str] = {}
    notes: list[str] = []
    for name, mod in block.named_modules():
        if any(name.startswith(p + ".") for p in plan if p):
            continue
        pre = f"{name}." if name else ""
        got = _region(mod, ATTENTION_LAYOUTS) or _region(mod, MLP_LAYOUTS)
        if got is not None and not any(k.startswith(pre) for k in plan if name):
            cols, row = got
            for c in cols:
                blocked = c in BLOCKED_QKV or (c in FUSED_QKV and _config_qkv(mod, c) == "mha")
                plan[f"{pre}{c}"] = "colwise_qkv" if blocked else "colwise"
            plan[f"{pre}{row}"] = "rowwise"
            # a region at the block itself (nn.TransformerEncoderLayer's linear1/linear2) shares its input with
            # attention: no region_input there. Nor on a forward taking more than its input (litgpt's attention
            # takes cos, sin, mask): region_input lays out exactly one input; its column-wise layers take the
            # replicated input themselves, and such a block gets no sequence-parallel entries (see _single_input)
            if name and _single_input(mod):
                plan[name] = "region_input"
        elif name and _sequential_mlp(mod):
            plan[f"{name}.0"] = "colwise"
            plan[f"{name}.{len(mod) - 1}"] = "rowwise"
            plan[name] = "region_input"
        elif any(_lin(mod, b) for b in BLOCKED_QKV):
            notes.append(f"{name}: fused [q|k|v] projection left replicated (not three blocks of the attention width)")
    return plan, notes


def _single_input(block: nn.Module) -> bool:
    """True when the block's forward takes one argument (the hidden states): sp_enter/sp_exit can wrap it."""
    import inspect

    if type(block).forward is nn.Module.forward:
        return True  # no forward of its own (a container): nothing says otherwise
    try:
        params = list(inspect.signature(block.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _output_head(model: nn.Module, lists: list[tuple[str, nn.ModuleList]]) -> str | None:
    """The last Linear-like layer outside the block lists (the output head), or None."""
    inside = tuple(f"{n}." for n, _ in lists)
    heads = [n for n, m in model.named_modules() if n and linear_like(m) and not n.startswith(inside)]
    return heads[-1] if heads else None


def transformer_plan(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
    """Plan from the structure: each block's attention/MLP regions split (see the module docstring),
    norms sequence-parallel, the output head gathered. Raises ValueError naming a block without regions."""
    lists = find_block_lists(model)
    if not lists:
        raise ValueError(f"{type(model).__name__} has no block list (an nn.ModuleList named blocks/layers/h...).")
    plan: dict[str, str] = {}
    for list_name, blocks in lists:
        first, notes = _block_plan(blocks[0])
        if not any(v == "rowwise" for v in first.values()):
            children = [f"{n} ({type(m).__name__})" for n, m in blocks[0].named_children()]
            raise ValueError(
                f"{list_name}.0 has no attention region (q/k/v, q_proj/k_proj/v_proj, query/key/value, qkv,"
                f" query_key_value + an output projection) and no MLP region (fc1/fc2, gate/up/down_proj, c_fc/c_proj,"
                f" ...); its children are {children}" + (f"; {'; '.join(notes)}" if notes else "")
            )
        for i, block in enumerate(blocks):
            if _block_plan(block)[0] != first:
                raise ValueError(f"{list_name}.{i} differs in structure from {list_name}.0; write the plan by hand.")
        for key, style in first.items():
            plan[f"{list_name}.*.{key}"] = style
        if not _single_input(blocks[0]) or any(
            not _single_input(blocks[0].get_submodule(k.rpartition(".")[0]))
            for k, v in first.items()
            if v == "rowwise" and k.rpartition(".")[0]
        ):
            continue  # sequence-parallel entries wrap the block's one input; HF blocks take masks, caches...
        for child, mod in blocks[0].named_children():
            if is_norm(mod):
                plan[f"{list_name}.*.{child}"] = "sequence_parallel"
        if len(blocks) == 1:
            plan[f"{list_name}.0"] = "sp_region"
        else:
            plan[f"{list_name}.0"] = "sp_enter"
            plan[f"{list_name}.{len(blocks) - 1}"] = "sp_exit"
    head = _output_head(model, lists)
    if head is not None and out_features(model.get_submodule(head)) % tp == 0:
        plan[head] = "colwise_gather"
    return plan


def mlp_plan(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
    """Plan for a network whose parameters all live in Linear layers, run in registration order: pairs (colwise,
    rowwise) with only element-wise functions between them; an odd last Linear stays replicated."""
    others = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False)) and not isinstance(m, nn.Linear)
    ]
    if others:
        raise ValueError(f"not a plain MLP: modules other than Linear hold parameters: {', '.join(others[:4])}")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) < 2:
        raise ValueError(f"not a plain MLP: it has {len(linears)} Linear layer(s); a pair needs 2")
    plan = {}
    for i in range(0, len(linears) - 1, 2):
        plan[linears[i]] = "colwise"
        plan[linears[i + 1]] = "rowwise"
    return plan


def hf_plan(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
    """The tensor-parallel plan a HuggingFace model carries (``_tp_plan``), mapped to the pack's styles."""
    found = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(getattr(m, "_tp_plan", None), Mapping) and getattr(m, "_tp_plan") and hasattr(m, "config")
    ]
    if not found:
        raise ValueError("no HuggingFace module with a `_tp_plan` (config.base_model_tp_plan)")
    prefix, owner = found[0]  # the outermost: its plan includes its base model's
    roots, names = plan_roots(model), [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    plan: dict[str, PlanValue] = {}
    lacking = []
    for pattern, style in owner._tp_plan.items():
        full = f"{prefix}.{pattern}" if prefix else pattern
        if not any(pattern_matches(n, full, roots) for n in names):
            if any(pattern_matches(n, full, roots) for n in params):
                lacking.append(f"{pattern!r}: {style!r} (names a parameter; the pack's plans name modules)")
            # else: HF writes one plan for every size of a family (dense MLP entries of an all-MoE config): unused
            continue
        if style not in HF_STYLES:
            why = HF_REFUSED.get(style, "a style this pack does not know")
            lacking.append(f"{pattern!r}: {style!r} ({why})")
            continue
        plan[full] = HF_STYLES[style]
    if lacking:
        raise ValueError(
            f"{type(owner).__name__}'s own plan uses style(s) the pack does not implement: {', '.join(lacking)}"
            f" (the pack maps {sorted(HF_STYLES)}); pass tp_plan='transformer' or your own mapping"
        )
    if not plan:
        raise ValueError(f"{type(owner).__name__}'s own plan matches none of its modules")
    return plan


BUILTIN_PLANS: dict[str, Callable[..., dict[str, str]]] = {
    "hf": hf_plan,
    "transformer": transformer_plan,
    "mlp": mlp_plan,
}
"""Built-in plan builders ``fn(model, *, tp) -> plan``, in the order ``tp_plan="auto"`` tries them."""


def tie_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` plus a vocab-parallel (``rowwise``) entry for each nn.Embedding tied to a column-split head: split on the
    vocabulary as the head's weight is, the two remain one parameter (Megatron's tied embedding)."""
    roots = plan_roots(model)
    modules = dict(model.named_modules())
    plan = dict(plan)
    for names in shared_parameters(model):
        owners = [n.rpartition(".")[0] for n in names]
        styles = {o: next((s for p, s in plan.items() if pattern_matches(o, p, roots)), None) for o in owners}
        if not any(s in ("colwise", "colwise_gather") for s in styles.values()):
            continue
        for o, s in styles.items():
            if s is None and isinstance(modules[o], nn.Embedding):
                plan[o] = "rowwise"
    return plan


def builtin_plan(model: nn.Module, name: str, *, tp: int = 1) -> tuple[str, dict[str, str]]:
    """(name, plan) of the built-in plan `name` for `model`; ``"auto"`` picks the first that matches."""
    if name != "auto" and name not in BUILTIN_PLANS:
        raise ValueError(
            f"Unknown tensor-parallel plan {name!r}; pass 'auto', one of {sorted(BUILTIN_PLANS)} or a mapping."
        )
    failures = []
    for candidate in BUILTIN_PLANS if name == "auto" else (name,):
        try:
            return candidate, tie_plan(model, BUILTIN_PLANS[candidate](model, tp=tp))
        except ValueError as err:
            failures.append(f"{candidate}: {err}")
    raise ValueError(
        f"No built-in tensor-parallel plan {'matches' if name == 'auto' else 'named ' + repr(name) + ' fits'}"
        f" {type(model).__name__}:\n  - "
        + "\n  - ".join(failures)
        + "\nPass tp_plan={pattern: style, ...} naming its layers (see lightning_dist.parallelize.tp.apply)."
        + suggest_plan(model)
    )


def suggest_plan(model: nn.Module) -> str:
    """A starting plan to paste and edit (YAML), from the Linear layers each module holds, or ''."""
    lines = []
    for name, mod in model.named_modules():
        kids = [n for n, k in mod.named_children() if linear_like(k)]
        if len(kids) >= 2:
            *cols, row = kids
            lines += [f"  {name + '.' if name else ''}{c}: colwise" for c in cols]
            lines.append(f"  {name + '.' if name else ''}{row}: rowwise")
    if not lines:
        return ""
    return (
        "\nA plan to start from (each module's last Linear row-wise, the others column-wise; check it against"
        " your forward):\nplan:\n" + "\n".join(lines[:24]) + ("\n  ..." if len(lines) > 24 else "")
    )
