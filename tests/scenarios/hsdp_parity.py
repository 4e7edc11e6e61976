"""Parity of hybrid sharding with single-device training (run under torchrun, 4 processes).

float64: every mesh (replicate x shard) 4x1, 2x2, 1x4 and zero stage 1, 2, 3 after 3 AdamW steps.
float32: hsdp 2x2 vs Lightning's DDPStrategy on the same work, both against the float32 reference.
Without a common seed (each rank its own random model) every replica starts from rank 0's model.
Also: the sampler kwargs come from `dp`, the logged loss equals the single-device loss.
"""

import sys

import torch
from _common import Classifier, emit, full_params, max_rel_diff, rank, reference, trainer

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.strategies import HybridShardStrategy

STEPS = 3
WORLD = 4
meshes = [(4, 1), (2, 2), (1, 4)]
stages = [1, 2, 3]
if len(sys.argv) > 1 and sys.argv[1] == "quick":
    meshes, stages = [(2, 2)], [3]

ref64 = reference(STEPS)
for rep, shard in meshes:
    for stage in stages:
        strategy = HybridShardStrategy(dp_replicate=rep, shard_size=shard, zero_stage=stage)
        module = Classifier()
        t = trainer(strategy, devices=WORLD, steps=STEPS)
        t.fit(module)
        diff = max_rel_diff(full_params(module), ref64)
        emit(
            kind="parity64",
            mesh=[rep, shard],
            stage=stage,
            diff=diff,
            sampler=strategy.distributed_sampler_kwargs,
            dp_size=strategy.mesh.dp_size,
            shape=list(strategy.mesh.spec.shape),
            seen=module.seen,
        )

# no common seed: each rank builds its own random model (seed 1000 + rank); the strategy must start every
# replica from rank 0's model (DDP's rule), on the FSDP2 path (2x2, ZeRO-3) and the all-reduce path (4x1, ZeRO-1)
ref_rank0 = reference(STEPS, seed=1000)
for rep, shard, stage in [(2, 2, 3), (4, 1, 1)]:
    module = Classifier(seed=1000 + rank())
    trainer(HybridShardStrategy(dp_replicate=rep, shard_size=shard, zero_stage=stage), devices=WORLD, steps=STEPS).fit(
        module
    )
    emit(
        kind="noseed",
        mesh=[rep, shard],
        stage=stage,
        diff=max_rel_diff(full_params(module), ref_rank0),
        own_seed_diff=max_rel_diff(full_params(module), reference(STEPS, seed=1000 + rank())),
    )

# float32: the bar is Lightning's own DDPStrategy on the same work
ref32 = reference(STEPS, dtype=torch.float32)
module = Classifier(dtype=torch.float32)
trainer("ddp", devices=WORLD, steps=STEPS, precision="32-true").fit(module)
ddp_diff = max_rel_diff(full_params(module), ref32)
module = Classifier(dtype=torch.float32)
trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=STEPS, precision="32-true").fit(module)
emit(kind="parity32", ddp=ddp_diff, hsdp=max_rel_diff(full_params(module), ref32))


# Lightning counts the strategy as distributed: it injects a DistributedSampler over `dp` (96 samples,
# 4 ranks, batch 4 -> 6 batches per rank), and `sync_dist` logging reduces over `dp`.
class Injected(Classifier):
    def train_dataloader(self):
        from _common import dataset
        from torch.utils.data import DataLoader

        return DataLoader(dataset(self.n, dtype=self.dtype_), batch_size=4, shuffle=True)


module = Injected()
t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=1, use_distributed_sampler=True)
t.fit(module)
sampler = t.train_dataloader.sampler
emit(
    kind="injection",
    sampler=type(sampler).__name__,
    replicas=getattr(sampler, "num_replicas", None),
    batches=t.num_training_batches,
)
