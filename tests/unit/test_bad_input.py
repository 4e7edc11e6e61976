"""Bad input across the pack: each case raises a clear error naming the value and the fix.

One row per case of ``docs/bad_input.md`` (the ids match; a test checks the table lists every case).
All of these are raised in one process, before any process group exists, i.e. on every rank of a job
before any collective. The cases that only show in a running job (empty data, NaN loss, a callback on
the wrong strategy) are in ``tests/distributed/test_bad_input_runtime.py``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _harness import ROOT, SCENARIOS
from torch import nn

sys.path.insert(0, str(SCENARIOS))
from _common import MLP  # noqa: E402

from lightning_dist import checkpoint as ckpt  # noqa: E402
from lightning_dist.callbacks import ExactEvaluation  # noqa: E402
from lightning_dist.mesh import MeshSpec  # noqa: E402
from lightning_dist.strategies import HybridShardStrategy, PipelineStrategy  # noqa: E402


def _spec(**kw):
    return MeshSpec(world_size=4, devices_per_node=4, **kw).resolve()


def _tp(**kw):
    from lightning_dist.strategies.tp import TensorParallelStrategy

    return TensorParallelStrategy(**kw)


def _plan(plan, width=16):
    from lightning_dist.parallelize.tp.plan import resolve_plan

    return resolve_plan(MLP(width=width), plan, tp=2)


def _tied_head_only():
    from lightning_dist.models import GPT
    from lightning_dist.parallelize.tp.plan import resolve_plan

    with torch.device("meta"):
        model = GPT(n_layer=1, n_head=2, n_embd=16, tie_weights=True)
    return resolve_plan(model, {"lm_head": "colwise_gather"}, tp=2)


def _two_paths():
    import lightning.pytorch as pl

    from lightning_dist.parallelize.tp.plan import resolve_plan

    module = pl.LightningModule()
    module.model, module.head = MLP(), nn.Linear(5, 4)  # `head` from the LightningModule and from `model`
    return resolve_plan(module, {"head": "colwise_gather"}, tp=2)


def _norm_per_head_list():
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    class Attn(nn.Module):  # one LayerNorm per head, paired with the heads by position (StableLM's q/k layernorm)
        def __init__(self) -> None:
            super().__init__()
            self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)
            self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))

        def forward(self, x):
            heads = torch.split(self.q(x).unflatten(-1, (4, 4)), 1, dim=-2)
            return self.o(torch.cat([n(h) for n, h in zip(self.norms, heads)], dim=-2).flatten(-2))

    net = nn.Module()
    net.blocks = nn.ModuleList([nn.Module()])
    net.blocks[0].attn = Attn()
    net.forward = lambda x: net.blocks[0].attn(x)
    net.example_input_array = torch.randn(2, 3, 16)
    return resolve_tp_plan(net, {"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}, tp=2)


def _styles_swapped():
    from lightning_dist.models import GPT
    from lightning_dist.parallelize.tp.plan import resolve_plan
    from lightning_dist.parallelize.tp.probe import probe_output

    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16)
    plan = {
        "blocks.*.attn.q": "rowwise",
        "blocks.*.attn.k": "rowwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "colwise",
        "blocks.*.mlp.fc1": "colwise",
        "blocks.*.mlp.fc2": "rowwise",
    }
    entries = resolve_plan(model, plan, tp=2)  # structurally fine: each region has both kinds
    return probe_output(model, torch.device("cpu"), entries)


def _head_registered_first():
    from lightning_dist.parallelize.pipeline.checks import check_staged_forward

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 4)  # head registered before the blocks
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

        def forward(self, x):
            x = self.emb(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return check_staged_forward(Net(), torch.randn(3, 8))


def _auto_no_plan():
    from lightning_dist.parallelize.tp.auto import builtin_plan

    net = nn.Module()
    net.conv, net.up, net.down = nn.Conv1d(4, 4, 1), nn.Linear(4, 8), nn.Linear(8, 4)
    return builtin_plan(net, "auto", tp=2)


def _tied_across_units():
    from lightning_dist.parallelize.fsdp import apply_fsdp

    model = MLP(depth=2)
    model.blocks[1].fc.weight = model.blocks[0].fc.weight  # shared by two FSDP units (the blocks)
    wrapper = nn.Module()
    wrapper.model = model
    return apply_fsdp(wrapper, None)


class _HFLike(nn.Module):
    """What lightning_dist.hf recognizes as a HuggingFace model: `config` and `save_pretrained`."""

    def __init__(self, meta_buffer: bool = False) -> None:
        super().__init__()
        self.config, self.fc = {}, nn.Linear(2, 2)
        self.register_buffer("freq", torch.zeros(2, device="meta" if meta_buffer else "cpu"), persistent=False)

    def save_pretrained(self, path, **kw):
        raise AssertionError("not reached")


def _hf_load(kind: str):
    import tempfile

    from safetensors.torch import save_file

    from lightning_dist.hf import load_hf_weights

    with tempfile.TemporaryDirectory() as name:  # not tmp_path: the check itself must write nothing there
        folder = Path(name)
        if kind != "nothing":
            save_file({"fc.weight": torch.zeros(2, 2), "extra": torch.zeros(1)}, str(folder / "model.safetensors"))
        return load_hf_weights(_HFLike(meta_buffer=kind == "meta"), folder / "sub" if kind == "nothing" else folder)


def _hf_export_exists():
    import tempfile

    from lightning_dist.hf import save_hf_pretrained

    with tempfile.TemporaryDirectory() as name:
        return save_hf_pretrained(_HFLike(), name)


def _offload(**kw):
    from lightning_dist.strategies.offload import OffloadStrategy

    return OffloadStrategy(**kw)


def _pipeline_tp(tp_plan):
    """A pipeline with tp=2 inside its stages whose plan leaves the network's output sharded."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MLP(depth=4, n_out=6)

        def pipeline_loss(self, out, y):
            return torch.nn.functional.cross_entropy(out, y)

    strategy = PipelineStrategy(pp=2, tp=2, split="params", tp_plan=tp_plan)
    strategy.connect(Module())
    strategy.validate_config(MeshSpec(world_size=4, devices_per_node=4, pp=2, tp=2).resolve())


def _schedule(schedule, pp, micro, stages=1):
    from lightning_dist.parallelize.pipeline.schedule import schedule_problems

    problems = schedule_problems(schedule, pp, micro, stages)
    if problems:  # the strategy raises these as one ValueError at set-up, before the first collective
        raise ValueError("; ".join(problems))


def _nvme(path):
    from lightning_dist.parallelize.offload import check_nvme_path

    return check_nvme_path(path, required_bytes=1)


def _offload_policy_zero1():
    from torch.distributed.fsdp import CPUOffloadPolicy

    return HybridShardStrategy(zero_stage=1, offload_policy=CPUOffloadPolicy())


def _pinned_policy_on_cpu():
    from torch.distributed.fsdp import CPUOffloadPolicy

    if torch.cuda.is_available():
        _pin_needs_cuda_skip()
    strategy = HybridShardStrategy(offload_policy=CPUOffloadPolicy())  # pin_memory=True is its default
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.validate_config(strategy.mesh_spec())


def _pin_needs_cuda_skip():
    pytest.skip("pinning works on this machine (CUDA present)")


def _pin():
    from lightning_dist.strategies import offload_fsdp2 as offload

    # the refusal is for machines without a CUDA device: build that condition on every machine
    saved, offload.CUDA_AVAILABLE = offload.CUDA_AVAILABLE, False
    try:
        return offload.FSDP2OffloadStrategy(pin_memory=True)
    finally:
        offload.CUDA_AVAILABLE = saved


def _master_weights():
    from lightning_dist.planner import state_bytes

    return state_bytes(precision="32-true", optimizer="adam", master_weights=True)


def _callback_setup(callback, strategy):
    callback.setup(SimpleNamespace(strategy=strategy), None, "fit")


def _bubble_on_hsdp():
    from lightning_dist.callbacks.pipeline_bubble import PipelineBubble

    _callback_setup(PipelineBubble(), HybridShardStrategy())


def _parity_on_deepspeed():
    from lightning_dist.callbacks.gradient_parity import GradientParityCheck

    pytest.importorskip("deepspeed", reason="DeepSpeed (the `deepspeed` extra) is not installed")
    _callback_setup(GradientParityCheck(), _offload())


def _other_model_checkpoint():
    saved = {k: v.shape for k, v in MLP(width=16).state_dict().items()}
    ckpt.check_compatible(saved, MLP(width=24))


def _untrusted_pickle(tmp):
    path = tmp / "evil.pt"
    torch.save({"state_dict": {}, "payload": SimpleNamespace(a=1)}, path)  # an arbitrary class: not weights
    ckpt.load(path, model=MLP())


def _port_in_use():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_dist.rendezvous import loopback_store

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        env = LightningEnvironment()
        env._main_port = busy.getsockname()[1]
        env.set_global_rank(0)
        env.set_world_size(2)
        loopback_store(env, timeout=__import__("datetime").timedelta(seconds=5))


# id -> (callable taking tmp_path, exception type, substrings the message must contain: the value and the fix)
def _exact_eval_loader(n: int, world: int, batch_size: int, *, may_skip: bool = True, same_sizes: bool = False):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.callbacks.exact_eval import _exact_loader

    return _exact_loader(
        DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size),
        num_replicas=world,
        rank=0,
        trim=True,
        may_skip=may_skip,
        same_sizes=same_sizes,
    )


CASES = {
    "mesh-tp-not-dividing-world": (lambda t: _spec(tp=3), ValueError, ["tp = 1 x 3 = 3", "divides 4"]),
    "mesh-shard-not-dividing": (lambda t: _spec(dp_shard=3), ValueError, ["dp_shard=3", "pick a divisor of 4"]),
    "mesh-product-not-world": (
        lambda t: _spec(dp_replicate=2, dp_shard=4),
        ValueError,
        ["= 8 != world_size=4", "e.g. dp_replicate=1, dp_shard=4"],
    ),
    "mesh-tp-cross-node": (
        lambda t: MeshSpec(world_size=8, devices_per_node=4, tp=8).resolve(),
        ValueError,
        ["tp=8", "allow_cross_node_tp=True"],
    ),
    "size-zero": (lambda t: HybridShardStrategy(pp=0), ValueError, ["pp=0", "integer >= 1"]),
    "size-bool": (lambda t: HybridShardStrategy(dp_replicate=True), ValueError, ["dp_replicate=True", '"auto"']),
    "zero-stage": (lambda t: HybridShardStrategy(zero_stage=4), ValueError, ["zero_stage=4", "1, 2 or 3"]),
    "ac-mode-unknown": (
        lambda t: HybridShardStrategy(activation_checkpointing="partial"),
        ValueError,
        ["activation_checkpointing='partial'", '"selective"', '"every:N"'],
    ),
    "ac-every-not-positive": (
        lambda t: PipelineStrategy(activation_checkpointing="every:0"),
        ValueError,
        ["'every:0'", "integer >= 1"],
    ),
    "ac-selective-op-unknown": (
        lambda t: HybridShardStrategy(activation_checkpointing="selective", selective_ac_ops=["aten.matmul_fast"]),
        ValueError,
        ["aten.matmul_fast", "not torch ops", "'aten.mm'"],
    ),
    # the strategies' validate_config (set-up, before the process group) calls this with their root device
    "offload-activations-on-cpu": (
        lambda t: __import__("lightning_dist.parallelize.ac", fromlist=["x"]).check_offload_device(
            True, torch.device("cpu")
        ),
        ValueError,
        ["offload_activations=True needs a CUDA device", "nothing to offload"],
    ),
    "offload-activations-all-checkpointed": (
        lambda t: HybridShardStrategy(activation_checkpointing="full", offload_activations=True),
        ValueError,
        ["offload_activations=True", "every:N"],
    ),
    "shard-size-word": (lambda t: HybridShardStrategy(shard_size="half"), ValueError, ["shard_size='half'", '"full"']),
    "shard-size-and-dp-shard": (
        lambda t: HybridShardStrategy(shard_size=2, dp_shard=2),
        ValueError,
        ["shard_size=2", "dp_shard=2", "not both"],
    ),
    "parallelize-fn-not-callable": (
        lambda t: HybridShardStrategy(parallelize_fn=3),
        ValueError,
        ["parallelize_fn=3", "fn(model, mesh)"],
    ),
    "tp-size": (lambda t: _tp(tp=0), ValueError, ["tp=0", "integer >= 1"]),
    "tp-plan-unknown-name": (lambda t: _tp(tp_plan="zigzag"), ValueError, ["plan='zigzag'", "'mlp'"]),
    "tp-plan-wrong-type": (lambda t: _tp(tp_plan=3), ValueError, ["got int", "mapping of pattern -> style"]),
    "tp-plan-unknown-style": (lambda t: _plan({"stem": "diagonal"}), ValueError, ["'diagonal'", "colwise"]),
    "tp-plan-indivisible": (
        lambda t: _plan({"blocks.*.fc": "colwise"}, width=15),
        ValueError,
        ["out_features=15", "tp=2", "choose a tp that divides 15"],
    ),
    "tp-plan-matches-nothing": (
        lambda t: _plan({"nothing.here": "colwise"}),
        ValueError,
        ["'nothing.here'", "match from the root", "module names look like"],
    ),
    "tp-plan-breaks-tie": (
        lambda t: _tied_head_only(),
        ValueError,
        ["['tok_emb.weight', 'lm_head.weight']", "train apart", "vocab-parallel", "'rowwise'"],
    ),
    "tp-plan-rowwise-input-not-split": (
        lambda t: _plan({"blocks.*.fc": "rowwise"}),
        ValueError,
        ["blocks.0.fc (Linear, rowwise) expects an input split", "'colwise'"],
    ),
    "tp-plan-output-left-split": (
        lambda t: _plan({"head": "colwise"}),
        ValueError,
        ["head (Linear, colwise) leaves its output split", "colwise_gather"],
    ),
    "tp-plan-styles-swapped": (
        lambda t: _styles_swapped(),
        ValueError,
        [
            "blocks.0.attn (and 1 more like it",
            "['q', 'k'] 'rowwise' run(s) before",
            "['v', 'proj'] 'colwise' run(s) after",
            "'blocks.*.attn.q': 'colwise'",
            "'blocks.*.attn.v': 'colwise', 'blocks.*.attn.proj': 'rowwise'",
        ],
    ),
    "tp-plan-pattern-two-paths": (
        lambda t: _two_paths(),
        ValueError,
        ["'head'", "matches 2 paths", "write the full path"],
    ),
    "tp-plan-norm-per-head-list": (
        lambda t: _norm_per_head_list(),
        ValueError,
        [
            "attn.norms holds one LayerNorm per slice of the split output of 'blocks.0.attn.q'",
            "Leave that region whole",
        ],
    ),
    "tp-auto-no-plan": (
        lambda t: _auto_no_plan(),
        ValueError,
        ["No built-in tensor-parallel plan matches", "A plan to start from", "rowwise"],
    ),
    "fsdp-tied-across-units": (
        lambda t: _tied_across_units(),
        ValueError,
        ["lie in different sharding units", "Choose `units`", "untie them"],
    ),
    "hf-weights-not-a-folder": (lambda t: _hf_load("nothing"), FileNotFoundError, ["not a folder of .safetensors"]),
    "hf-weights-mismatch": (
        lambda t: _hf_load("other"),
        ValueError,
        ["missing ['fc.bias']", "unexpected ['extra']", "strict=False"],
    ),
    "hf-weights-meta-buffers": (lambda t: _hf_load("meta"), ValueError, ["on the meta device", "init_empty_weights()"]),
    "hf-export-exists": (lambda t: _hf_export_exists(), FileExistsError, ["exists", "new folder"]),
    "pipeline-schedule-unknown": (
        lambda t: PipelineStrategy(schedule="zigzag"),
        ValueError,
        ["schedule='zigzag'", "1f1b"],
    ),
    "pipeline-microbatches-too-few": (
        lambda t: _schedule("1f1b", 4, 2),
        ValueError,
        ["n_microbatches >= pp = 4", "n_microbatches=2"],
    ),
    "pipeline-microbatches-zero": (
        lambda t: _schedule("gpipe", 2, 0),
        ValueError,
        ["n_microbatches=0", "integer >= 1"],
    ),
    "pipeline-zb-stages": (lambda t: _schedule("zero_bubble", 2, 4, 1), ValueError, ["stages_per_rank=2", "got 1"]),
    "pipeline-head-registered-first": (
        lambda t: _head_registered_first(),
        ValueError,
        [
            "registers its children in the order emb -> head -> blocks",
            "runs them as emb -> blocks -> head",
            "registration order",
            "assign emb then blocks then head",
        ],
    ),
    "pipeline-consolidated-file": (
        lambda t: PipelineStrategy(save_distributed_checkpoint=False),
        ValueError,
        ["save_distributed_checkpoint=True", "dcp_to_torch_save"],
    ),
    "async-checkpoint-consolidated": (
        lambda t: HybridShardStrategy(async_checkpoint=True, save_distributed_checkpoint=False),
        ValueError,
        ["async_checkpoint=True", "save_distributed_checkpoint=True"],
    ),
    "pipeline-tp-sharded-output": (
        lambda t: _pipeline_tp({"head": "colwise"}),
        ValueError,
        ["model.head (Linear, colwise)", "leaves its output split", "colwise_gather"],
    ),
    "offload-tier": (lambda t: _offload(optimizer="gpu"), ValueError, ["optimizer='gpu'", '"cpu", "nvme" or None']),
    "offload-nvme-without-path": (lambda t: _offload(optimizer="nvme"), ValueError, ["nvme_path="]),
    "offload-nvme-path-missing": (lambda t: _nvme(t / "absent"), ValueError, ["absent", "create the folder"]),
    "offload-nvme-path-is-file": (
        lambda t: _nvme(ROOT / "pyproject.toml"),
        ValueError,
        ["pyproject.toml", "is not a folder"],
    ),
    "offload-params-stage2": (
        lambda t: _offload(parameters="cpu", zero_stage=2),
        ValueError,
        ["parameters='cpu'", "zero_stage=2", "pass `zero_stage=3`"],
    ),
    "offload-policy-zero1": (lambda t: _offload_policy_zero1(), ValueError, ["zero_stage=1", "zero_stage=2 or 3"]),
    "compile-option-type": (lambda t: HybridShardStrategy(compile=3), ValueError, ["compile=3", "block class names"]),
    "compile-with-parallelize-fn": (
        lambda t: HybridShardStrategy(compile=True, parallelize_fn=lambda m, mesh: None),
        ValueError,
        ["parallelize_fn", "apply_compile"],
    ),
    "compile-zero-bubble": (
        lambda t: PipelineStrategy(schedule="zero_bubble", compile=True),
        ValueError,
        ["schedule='zero_bubble'", "'1f1b'"],
    ),
    "compile-deepspeed-offload": (lambda t: _offload(compile=True), ValueError, ["compile=True", "offload_fsdp2"]),
    "offload-policy-pinned-on-cpu": (
        lambda t: _pinned_policy_on_cpu(),
        ValueError,
        ["pin_memory=True", "CPUOffloadPolicy(pin_memory=False)"],
    ),
    "precision-pin-memory-on-cpu": (lambda t: _pin(), ValueError, ["pin_memory=True", "pass False"]),
    "precision-master-weights-fp32": (
        lambda t: _master_weights(),
        ValueError,
        ["master_weights=True", "'32-true'", "16-bit precision"],
    ),
    "callback-bubble-on-hsdp": (
        lambda t: _bubble_on_hsdp(),
        TypeError,
        ["PipelineBubble", "HybridShardStrategy", "PipelineStrategy("],
    ),
    "callback-parity-on-deepspeed": (
        lambda t: _parity_on_deepspeed(),
        ValueError,
        ["OffloadStrategy", "Use it with ddp, hsdp/fsdp2"],
    ),
    "exact-eval-mode-unknown": (
        lambda t: ExactEvaluation(mode="drop"),
        ValueError,
        ["mode='drop'", "'trim'", "'mask'"],
    ),
    "exact-eval-full-batches-trim": (
        lambda t: ExactEvaluation(full_batches=True),
        ValueError,
        ["full_batches=True", "mode='mask'"],
    ),
    "exact-eval-empty-batch-sharded": (
        lambda t: _exact_eval_loader(10, 4, 1, may_skip=False),
        ValueError,
        ["10 evaluation samples on 4", "batch_size=1", "batch_size >= 2", "mode='mask'"],
    ),
    "exact-eval-pipeline-uneven": (
        lambda t: _exact_eval_loader(31, 2, 3, same_sizes=True),
        ValueError,
        ["31 evaluation samples in batches of 3 on 2", "micro-batches", "mode='mask', full_batches=True"],
    ),
    "exact-eval-fewer-samples-than-ranks": (
        lambda t: _exact_eval_loader(3, 4, 2),
        ValueError,
        ["3 samples for 4 data-parallel ranks", "mode='mask'"],
    ),
    "checkpoint-other-model": (
        lambda t: _other_model_checkpoint(),
        ValueError,
        ["'stem.weight'", "[16, 12]", "[24, 12]", "different model"],
    ),
    "checkpoint-missing": (lambda t: ckpt.resolve_path(t / "nope.ckpt"), FileNotFoundError, ["nope.ckpt"]),
    "checkpoint-untrusted-pickle": (_untrusted_pickle, RuntimeError, ["weights_only=True", "add_safe_globals"]),
    "timeout-wrong-type": (
        lambda t: HybridShardStrategy(timeout="30"),
        TypeError,
        ["timeout='30'", "seconds as a number or a datetime.timedelta", "timeout=1800"],
    ),
    "timeout-negative": (
        lambda t: PipelineStrategy(timeout=-5),
        ValueError,
        ["timeout=-5", "positive, finite number of seconds"],
    ),
    "mesh-before-fit": (lambda t: HybridShardStrategy().mesh, RuntimeError, ["setup_environment", "Trainer.fit"]),
    "rendezvous-port-in-use": (lambda t: _port_in_use(), RuntimeError, ["MASTER_PORT=", "pick a free port"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_clear_error(case, tmp_path):
    fn, exc, needles = CASES[case]
    with pytest.raises(exc) as info:
        fn(tmp_path)
    message = str(info.value)
    missing = [n for n in needles if n not in message]
    assert not missing, f"{case}: {missing} not in {message!r}"
    assert "weights_only=False" not in message  # never steer users to arbitrary code execution
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "evil.pt"]), "a failing check wrote files"


def test_table_in_docs_lists_every_case():
    table = (ROOT / "docs" / "bad_input.md").read_text()
    runtime = [
        "empty-dataset",
        "fewer-samples-than-ranks",
        "smaller-than-one-batch",
        "nan-loss-one-rank",
        "callback-wrong-strategy-in-job",
        "mesh-in-job",
        "tp-output-differs",
        "iterable-data-ends-early",
    ]
    absent = [c for c in [*CASES, *runtime] if f"`{c}`" not in table]
    assert not absent, f"docs/bad_input.md lacks {absent}"
    assert len(CASES) + len(runtime) >= 25


def test_guards_train_data_problems_pure():
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist.callbacks.guards import train_data_problems

    data = TensorDataset(torch.zeros(6, 2))
    assert train_data_problems(DataLoader(data, batch_size=2), dp_size=4) == []
    assert "6 samples but there are 8" in train_data_problems(DataLoader(data), dp_size=8)[0]
    assert "batch_size=4" in train_data_problems(DataLoader(data, batch_size=4, drop_last=True), dp_size=2)[0]
    assert "empty" in train_data_problems(DataLoader(TensorDataset(torch.zeros(0, 2))), dp_size=1)[0]


def test_rendezvous_only_for_loopback_lightning_environment():
    from datetime import timedelta

    from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    from lightning_dist.rendezvous import is_loopback, loopback_store

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.7") and not is_loopback("node-3")
    assert loopback_store(TorchElasticEnvironment(), timeout=timedelta(seconds=1)) is None
    env = LightningEnvironment()
    import os

    old = os.environ.get("MASTER_ADDR")
    os.environ["MASTER_ADDR"] = "10.0.0.7"
    try:
        assert loopback_store(env, timeout=timedelta(seconds=1)) is None  # a routable address: default env://
    finally:
        if old is None:
            del os.environ["MASTER_ADDR"]
        else:
            os.environ["MASTER_ADDR"] = old


def test_attempt_store_prefixes_keys_with_the_torchrun_attempt(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    from lightning_dist.rendezvous import attempt_store, job_store

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    env = TorchElasticEnvironment()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(env, timeout=timedelta(seconds=5)) is None  # workers host their own store: default path
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    store = job_store(env, timeout=timedelta(seconds=5))
    store.set("rank_0", "addr")
    # the failed attempt's keys stay where they were; this attempt's live under its own prefix
    assert server.get("lightning_dist/attempt_1/rank_0") == b"addr"
