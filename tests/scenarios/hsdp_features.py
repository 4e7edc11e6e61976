"""HybridShardStrategy features on 4 processes (torchrun): meta-device init through `configure_model`,
activation checkpointing, unit class names, a user `parallelize_fn`, bf16-mixed, and `sync_dist` over dp."""

import torch
from _common import MLP, Classifier, emit, full_params, max_rel_diff, rank, reference, trainer
from torch.distributed.tensor import DTensor

from lightning_dist.strategies import HybridShardStrategy

STEPS, WORLD = 3, 4
ref = reference(STEPS)


class Counting(Classifier):
    def training_step(self, batch, batch_idx):
        # a sum over the data-parallel ranks: 16 samples per step, whatever the mesh
        self.log("samples", float(len(batch[0])), reduce_fx="sum", sync_dist=True, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


# 1. activation checkpointing (full, class names, selective, every 2nd block) + units by class name: same numbers as
#    single-device training
for kw in (
    {"activation_checkpointing": True},
    {"units": ["Block"]},
    {"activation_checkpointing": ["Block"]},
    {"activation_checkpointing": "selective"},
    {"activation_checkpointing": "every:2"},
):
    module = Counting()
    t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2, **kw), devices=WORLD, steps=STEPS)
    t.fit(module)
    emit(
        kind="option",
        option=str(kw),
        diff=max_rel_diff(full_params(module), ref),
        logged=float(t.callback_metrics["samples"]),
    )


# 2. a model created on the meta device in configure_model; the mesh is visible there
class MetaInit(Classifier):
    def __init__(self):
        super().__init__()
        self.model = None
        self.seen_mesh = None

    def configure_model(self):
        if self.model is not None:
            return
        self.seen_mesh = (self.device_mesh.mesh_dim_names, tuple(self.device_mesh.shape))
        self.model = MLP()  # under the strategy's init context: meta device, materialized after sharding


module = MetaInit()
torch.manual_seed(100 + rank())  # no common seed: replicas must still materialize the same shards
t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=2)
t.fit(module)
w = module.model.blocks[0].fc.weight
emit(
    kind="meta",
    digest=[p.full_tensor().sum().item() for p in module.parameters()],
    mesh=module.seen_mesh,
    is_dtensor=isinstance(w, DTensor),
    placements=[str(p) for p in w.placements] if isinstance(w, DTensor) else None,
    local_rows=w.to_local().shape[0],
    finite=all(torch.isfinite(p.full_tensor()).all().item() for p in module.parameters()),
)

# 3. a user parallelize_fn replaces the built-in plan
calls = []


def my_plan(lightning_module, mesh):
    from torch.distributed.fsdp import fully_shard

    calls.append(mesh.spec.shape)
    for block in lightning_module.model.blocks:
        fully_shard(block, mesh=mesh.fsdp_mesh())
    fully_shard(lightning_module.model, mesh=mesh.fsdp_mesh())


module = Classifier()
trainer(HybridShardStrategy(shard_size=4, parallelize_fn=my_plan), devices=WORLD, steps=STEPS).fit(module)
emit(kind="parallelize_fn", calls=[list(c) for c in calls], diff=max_rel_diff(full_params(module), ref))

# 4. bf16-mixed: blocks compute in bf16, parameters (and optimizer state) stay fp32
dtypes = []
module = Classifier(dtype=torch.float32)
hook = lambda mod, args, out: dtypes.append(str(out.dtype))  # noqa: E731
for block in module.model.blocks:
    block.fc.register_forward_hook(hook)
t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=2, precision="bf16-mixed")
t.fit(module)
emit(
    kind="bf16",
    compute=sorted(set(dtypes)),
    params=sorted({str(p.dtype) for p in module.parameters()}),
    loss=float(t.callback_metrics["train_loss"]),
)


# 5. validate() after fit() on the same Trainer reuses the sharded module; the loss equals single-device
class Validating(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        from _common import dataset
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(
            dataset(32, seed=2), shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs
        )
        return DataLoader(sampler.dataset, batch_size=8, sampler=sampler)


module = Validating()
t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=STEPS, num_sanity_val_steps=0)
t.fit(module)
val = t.validate(module, verbose=False)[0]["val_loss"]
net = MLP().double()
net.load_state_dict({k.removeprefix("model."): v for k, v in ref.items()})
from _common import dataset  # noqa: E402

x, y = dataset(32, seed=2).tensors
expected = torch.nn.functional.cross_entropy(net(x), y).item()
# after a forward-only pass the strategy reshards: root parameters are local shards again (DTensors)
emit(
    kind="validate_after_fit",
    val=val,
    expected=expected,
    resharded=all(isinstance(p, DTensor) for p in module.parameters()),
)

# 6. bf16-true: parameters and compute in bf16 (Lightning's HalfPrecision converts before sharding)
module = Classifier(dtype=torch.bfloat16)
t = trainer(HybridShardStrategy(dp_replicate=2, shard_size=2), devices=WORLD, steps=2, precision="bf16-true")
t.fit(module)
emit(
    kind="bf16_true",
    params=sorted({str(p.dtype) for p in module.parameters()}),
    loss=float(t.callback_metrics["train_loss"]),
)
