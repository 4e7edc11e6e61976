"""Per-block torch.compile (inductor on CPU) against eager single-device training, float64, 2 processes.

hsdp (FSDP2 over 2 ranks, with activation checkpointing too), tp (tp=2) and pipeline_1f1b (pp=2), each with
``compile=True``, 3 AdamW steps, against the eager single-device reference; every block really compiled;
state-dict keys unchanged (no ``_orig_mod.``). Also (eager) tp=2 with an FSDP2 ``CPUOffloadPolicy``: a mesh
whose data-parallel size is 1 still gets FSDP2 with the policy, and trains as the reference does.
"""

import os
import time

import torch.nn.functional as F
from _common import Block, Classifier, emit, full_params, max_rel_diff, reference, trainer
from torch.distributed.fsdp import CPUOffloadPolicy

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.parallelize.fsdp import offload_policies
from lightning_dist.strategies import HybridShardStrategy, PipelineStrategy, TensorParallelStrategy

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # 2 processes share the test machine's cores
STEPS, DEPTH = 3, 2
# the MLP's TP plan: gathered column-parallel stem and blocks, a row-parallel head fed whole inputs
TP_PLAN = {
    "stem": "colwise_gather",
    "blocks.*.fc": "colwise_gather",
    "head": {"style": "rowwise", "input": "replicate"},
}


class PipeClassifier(Classifier):
    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)


def compiled_blocks(module) -> list[bool]:
    # FSDP2 swaps a unit's class for a subclass (FSDPBlock): isinstance, not the class name
    return [getattr(m, "_compiled_call_impl", None) is not None for m in module.modules() if isinstance(m, Block)]


ref = reference(STEPS, depth=DEPTH)
cases = {
    "hsdp": lambda: HybridShardStrategy(compile=True),
    "hsdp_ac": lambda: HybridShardStrategy(compile=True, activation_checkpointing=True),
    # selective AC under compile: the checkpoint (with its op policy) captured inside each compiled block
    "hsdp_sac": lambda: HybridShardStrategy(compile=True, activation_checkpointing="selective"),
    "tp_sac": lambda: TensorParallelStrategy(tp=2, tp_plan=TP_PLAN, compile=True, activation_checkpointing="selective"),
    "tp": lambda: TensorParallelStrategy(tp=2, tp_plan=TP_PLAN, compile=True),
    "pipeline_1f1b": lambda: PipelineStrategy(schedule="1f1b", split="params", compile=True),
    "tp_offload": lambda: TensorParallelStrategy(
        tp=2, tp_plan=TP_PLAN, offload_policy=CPUOffloadPolicy(pin_memory=False)
    ),
}
for name, make in cases.items():
    module = (PipeClassifier if name.startswith("pipeline") else Classifier)(depth=DEPTH)
    start = time.perf_counter()
    trainer(make(), devices=2, steps=STEPS).fit(module)
    seconds = time.perf_counter() - start
    params = full_params(module)
    if name.startswith("pipeline"):  # each stage holds its own parameters under their single-device names
        diff = max_rel_diff(params, {k: v for k, v in ref.items() if k in params})
    else:
        diff = max_rel_diff(params, ref)
    policies = [type(p).__name__ for p in offload_policies(module).values()]
    emit(
        kind="compile",
        case=name,
        diff=diff,
        compiled=compiled_blocks(module),
        keys=sorted(params),
        seconds=seconds,
        policies=policies,
    )
