"""Which of transformers' causal LMs the pipeline splits: every model type, a tiny random config, float64, one stage
per block checked against the whole model (outputs and gradients). A survey, not a test; docs/strategies/pipeline.md.

    python benchmarks/hf_pipeline_families.py [--models llama,bloom] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import warnings
from collections import Counter

import torch

# the same small sizes for every config that has the field (a config rejecting one keeps its default)
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    n_embd=32,
    n_layer=4,
    n_head=4,
    num_layers=4,
    d_model=32,
    ffn_dim=64,
    word_embed_proj_dim=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=64,
    # multi-head latent attention (DeepSeek-V2/V3 and their kin): the rotary and latent widths
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    kv_lora_rank=16,
    q_lora_rank=16,
    rotary_dim=4,  # GPT-J, CodeGen: rotary on part of each head
    vocab_size_per_layer_input=64,  # Gemma 3n/4's per-layer inputs
    hidden_size_per_layer_input=8,
    shared_intermediate_size=16,
    first_dense_intermediate_size=32,
    index_head_dim=8,  # sparse-attention indexers (DeepSeek-V3.2, GLM-DSA)
    index_n_heads=2,
    n_group=2,  # group-limited routing: 2 groups of 2 experts, the top 1 group
    topk_group=1,
)


class _Timeout(Exception):
    pass


def set_field(cfg, key: str, value) -> None:
    """`cfg.key = value` where the config has the field as a plain attribute; a field it derives, holds per layer or
    validates against others keeps its default."""
    try:
        if hasattr(cfg, key) and not isinstance(getattr(type(cfg), key, None), property):
            setattr(cfg, key, value)
    except Exception:
        pass


def tiny_config(model_type: str):
    """The model type's default config at the SMALL sizes, 4 layers of its layer types."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    _shrink(cfg)
    return cfg


def _shrink(cfg) -> None:
    """SMALL on `cfg` and on each config it holds (a multimodal model's text and vision configs)."""
    from transformers import PretrainedConfig

    for key, value in SMALL.items():
        set_field(cfg, key, value)
    try:  # (a heterogeneous config refuses global reads of per-layer fields)
        latent = getattr(cfg, "kv_lora_rank", None)
    except Exception:
        latent = None
    if latent:  # latent attention expands its keys per head: as many as the queries
        set_field(cfg, "num_key_value_heads", getattr(cfg, "num_attention_heads", None))
    if getattr(cfg, "layer_types", None) and not isinstance(getattr(type(cfg), "layer_types", None), property):
        types = list(cfg.layer_types)
        set_field(cfg, "layer_types", (types + types[-1:] * 4)[:4])
    for value in list(vars(cfg).values()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)


def _model(model_type: str) -> torch.nn.Module:
    import transformers as tf

    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").double()


def survey(model_types: list[str], seconds: int = 60) -> list[dict]:
    from lightning_dist.parallelize.pipeline.checks import staged_forward_problem
    from lightning_dist.parallelize.pipeline.hf import hf_example_inputs

    def timeout(*_):
        raise _Timeout(f"over {seconds} s")

    signal.signal(signal.SIGALRM, timeout)
    rows = []
    for model_type in model_types:
        signal.alarm(seconds)
        try:
            try:  # the tiny config must build and run whole first; else the row says why not (not the pack's doing)
                net = _model(model_type)
                sample = hf_example_inputs(net)
                net(**sample)
            except Exception as err:
                rows.append(dict(model=model_type, result="not built", why=f"{type(err).__name__}: {err}"))
                continue
            try:
                problem = staged_forward_problem(net, sample)
                rows.append(dict(model=model_type, result="splits" if problem is None else "refused", why=problem))
            except (TypeError, ValueError) as err:  # a layout none of the routes takes: refused too
                rows.append(dict(model=model_type, result="refused", why=str(err)))
            except Exception as err:  # the check itself failing: the pack's bug
                rows.append(dict(model=model_type, result="crashed", why=f"{type(err).__name__}: {err}"))
        finally:
            signal.alarm(0)
            print(f"{model_type:28s} {rows[-1]['result']:10s} {(rows[-1]['why'] or '')[:110]}".replace("\n", " "))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tf.logging.set_verbosity_error()
    limit = 16 * 2**30  # a default config too large for the machine fails its allocation, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    types = [m for m in args.models.split(",") if m] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = survey(types)
    counts = Counter(r["result"] for r in rows)
    print(f"transformers {tf.__version__}: {len(rows)} causal LMs; " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(transformers=tf.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
