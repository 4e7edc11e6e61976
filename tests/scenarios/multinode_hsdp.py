"""Two simulated nodes x 2 processes (two torchrun launches on loopback): `"auto"` hybrid sharding shards
inside a node and replicates across the nodes, and still equals single-device training."""

import os

from _common import Classifier, emit, full_params, max_rel_diff, reference, trainer

import lightning_dist  # noqa: F401

STEPS = 3
module = Classifier()
t = trainer("hsdp", devices=2, num_nodes=2, steps=STEPS)
t.fit(module)
mesh = t.strategy.mesh
rank = t.global_rank
emit(kind="multinode", node=int(os.environ["GROUP_RANK"]), shape=list(mesh.spec.shape),
     shard_group=mesh.spec.group_ranks(rank, "dp_shard"), replicate_group=mesh.spec.group_ranks(rank, "dp_replicate"),
     diff=max_rel_diff(full_params(module), reference(STEPS)))
