"""Two simulated nodes x 2 processes (two torchrun launches on loopback): `"auto"` hybrid sharding shards
inside a node and replicates across the nodes, and still equals single-device training."""

import os

from _common import Classifier, emit, full_params, max_rel_diff, reference, trainer

import lightning_dist  # noqa: F401
from lightning_dist.callbacks import CommunicationLedger
from lightning_dist.mesh import DIM_NAMES, DP

STEPS = 3


class Quiet(Classifier):
    def log(self, *args, **kwargs):  # no sync_dist logging: the ledger then sees training traffic only
        pass


module = Quiet()
ledger = CommunicationLedger(print_table=False, log=False)
t = trainer("hsdp", devices=2, num_nodes=2, steps=STEPS, callbacks=[ledger])
t.fit(module)
mesh = t.strategy.mesh
rank = t.global_rank
# which collectives left the node: a group crosses nodes when its ranks live on more than one node
traffic = {}
for step in ledger.steps:
    for (op, dim), (_, nbytes) in step.items():
        nodes = {r // 2 for r in mesh.spec.group_ranks(rank, dim)} if dim in DIM_NAMES + (DP,) else {-1}
        key = f"{op}@{dim}"
        traffic[key] = {"bytes": traffic.get(key, {}).get("bytes", 0) + nbytes, "cross_node": len(nodes) > 1}
emit(
    kind="multinode",
    node=int(os.environ["GROUP_RANK"]),
    shape=list(mesh.spec.shape),
    traffic=traffic,
    shard_group=mesh.spec.group_ranks(rank, "dp_shard"),
    replicate_group=mesh.spec.group_ranks(rank, "dp_replicate"),
    diff=max_rel_diff(full_params(module), reference(STEPS)),
)
