"""Tensor-parallel plans in one process (no process group): matching, built-ins, printing, every error."""

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_dist  # noqa: F401  (registers the strategies)
from lightning_dist.mesh import MeshSpec
from lightning_dist.models import GPT, ShapesCNN, ViT
from lightning_dist.parallelize.tp.auto import BUILTIN_PLANS, builtin_plan
from lightning_dist.parallelize.tp.plan import format_plan, resolve_plan
from lightning_dist.strategies import TensorParallelStrategy


def meta(build):
    with torch.device("meta"):
        return build()


class Wrapped(pl.LightningModule):
    """The strategy sees the LightningModule, so names carry its attribute (``model.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class FusedAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.num_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class FFN(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class FusedBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = (
            nn.LayerNorm(dim),
            FusedAttention(dim, n_heads),
            nn.LayerNorm(dim),
            FFN(dim),
        )


class FusedNet(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FusedBlock(dim, n_heads) for _ in range(depth))
        self.out = nn.Linear(dim, 10)


def plain_mlp(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(12, hidden), nn.GELU(), nn.Linear(hidden, 16), nn.Linear(16, 6))


def gpt(**kw) -> nn.Module:
    return meta(lambda: GPT(**{"n_layer": 2, "n_head": 4, "n_embd": 32, **kw}))


# ---- built-in plans and matching -----------------------------------------------------------------
def test_auto_picks_the_matching_builtin_plan():
    assert builtin_plan(gpt(), "auto", tp=2)[0] == "transformer"
    assert builtin_plan(meta(lambda: ViT(dim=32, n_heads=4)), "auto", tp=2)[0] == "transformer"
    assert builtin_plan(meta(FusedNet), "auto", tp=2)[0] == "transformer"
    assert builtin_plan(meta(plain_mlp), "auto", tp=2)[0] == "mlp"
    assert list(BUILTIN_PLANS) == ["hf", "transformer", "mlp"]


def test_auto_fails_naming_what_it_could_not_match():
    with pytest.raises(ValueError) as err:
        builtin_plan(meta(ShapesCNN), "auto", tp=2)
    msg = str(err.value)
    assert "No built-in tensor-parallel plan matches ShapesCNN" in msg
    assert "transformer: blocks.0 has no attention region" in msg  # what the block lacks
    assert "hf: no HuggingFace module with a `_tp_plan`" in msg
    assert "mlp: not a plain MLP: modules other than Linear hold parameters: stem.0 (Conv2d)" in msg
    with pytest.raises(ValueError, match="Unknown tensor-parallel plan 'nope'"):
        builtin_plan(gpt(), "nope")


def test_gpt_plan_splits_heads_and_gathers_the_output_head():
    entries = resolve_plan(Wrapped(gpt()), "auto", tp=2)
    styles = {e.fqn: e.style for e in entries}
    for i in (0, 1):
        for name in "qkv":
            assert styles[f"model.blocks.{i}.attn.{name}"] == "colwise"
        assert styles[f"model.blocks.{i}.attn.proj"] == "rowwise"
        assert styles[f"model.blocks.{i}.mlp.fc1"] == "colwise"
        assert styles[f"model.blocks.{i}.mlp.fc2"] == "rowwise"
        assert styles[f"model.blocks.{i}.norm1"] == "sequence_parallel"
    assert styles["model.blocks.0"] == "sp_enter" and styles["model.blocks.1"] == "sp_exit"
    assert styles["model.lm_head"] == "colwise_gather"
    assert "model.tok_emb" not in styles  # the embedding stays replicated
    assert styles["model.blocks.0.attn"] == styles["model.blocks.1.mlp"] == "region_input"
    sp_entries = [e for e in entries if e.style.startswith("sp") or e.style == "sequence_parallel"]
    assert sp_entries and not any(e.active for e in sp_entries)  # no-ops without sequence parallelism
    assert all(e.active for e in resolve_plan(Wrapped(gpt()), "auto", tp=2, sequence_parallel=True))


def test_output_head_left_replicated_when_not_divisible():
    styles = {e.fqn: e.style for e in resolve_plan(gpt(vocab_size=33), "transformer", tp=2)}
    assert "lm_head" not in styles and styles["blocks.0.attn.q"] == "colwise"


def test_fused_qkv_and_mlp_plans():
    styles = {e.fqn: e.style for e in resolve_plan(meta(FusedNet), "auto", tp=4, sequence_parallel=True)}
    assert styles["layers.2.attn.qkv"] == "colwise" and styles["layers.2.attn.proj"] == "rowwise"
    assert styles["layers.0.ln_2"] == "sequence_parallel"
    assert styles["layers.0"] == "sp_enter" and styles["layers.2"] == "sp_exit"
    styles = {e.fqn: e.style for e in resolve_plan(meta(plain_mlp), "mlp", tp=2)}
    assert styles == {"0": "colwise", "2": "rowwise"}  # an odd last Linear stays replicated


def test_patterns_match_from_the_root_or_its_children_and_plans_load_from_yaml():
    plan = yaml.safe_load(
        """
        blocks.*.attn.q: colwise
        model.blocks.*.attn.proj: {style: rowwise, output: replicate}
        "*.mlp.fc1": colwise
        blocks.1.mlp.fc2: rowwise
        blocks.0.mlp.fc2: rowwise
        """
    )
    entries = resolve_plan(Wrapped(gpt()), plan, tp=2)
    assert [e.fqn for e in entries] == [
        "model.blocks.0.attn.q",
        "model.blocks.0.attn.proj",
        "model.blocks.0.mlp.fc1",
        "model.blocks.0.mlp.fc2",
        "model.blocks.1.attn.q",
        "model.blocks.1.attn.proj",
        "model.blocks.1.mlp.fc1",
        "model.blocks.1.mlp.fc2",
    ]
    assert entries[1].options == {"output": "replicate"} and entries[1].pattern == "model.blocks.*.attn.proj"


def test_format_plan_shows_style_and_local_shard_shapes():
    entries = resolve_plan(Wrapped(gpt()), "auto", tp=2)
    text = format_plan(entries, tp=2)
    assert "Tensor-parallel plan (tp=2)" in text
    row = next(line for line in text.splitlines() if "model.blocks.0.mlp.fc1" in line)
    assert "colwise" in row and "weight 128x32, bias 128" in row and "weight 64x32, bias 64" in row
    row = next(line for line in text.splitlines() if "model.blocks.0.mlp.fc2 " in line)
    assert "rowwise" in row and "weight 32x64, bias 32" in row  # input features split, bias replicated
    assert "sequence_parallel (off)" in text
    by_fqn = {e.fqn: e for e in entries}
    assert by_fqn["model.lm_head"].shapes == (("weight", (32, 32), (16, 32)),)


# ---- every error -----------------------------------------------------------------------------------
def test_heads_not_divisible_by_tp():
    # 48 features split fine over 4 ranks, but 6 heads do not
    with pytest.raises(ValueError, match=r"the attention module has 6 heads, not divisible by tp=4"):
        resolve_plan(gpt(n_head=6, n_embd=48), "auto", tp=4)
    with pytest.raises(ValueError, match=r"has 4 heads, not divisible by tp=8"):
        resolve_plan(meta(lambda: FusedNet(dim=64, n_heads=4)), "auto", tp=8)


def test_a_config_that_refuses_a_global_read_is_read_as_absent():
    """transformers' heterogeneous configs (Gemma 4 unified) raise their own error, not AttributeError, when a
    per-layer field is read globally (`config.head_dim`): the plan's checks read the module's own counts instead
    (before: that error escaped from resolving the plan, at tp=2 too)."""

    class PerLayerError(Exception):
        pass

    class PerLayerConfig:
        hidden_size = 32

        def __getattribute__(self, name):
            if name in ("head_dim", "num_attention_heads", "num_key_value_heads"):
                raise PerLayerError(f"{name!r} is a per-layer attribute")
            return object.__getattribute__(self, name)

    def build():
        net = FusedNet(dim=64, n_heads=4)
        for block in net.layers:
            block.attn.config = PerLayerConfig()
        return net

    assert resolve_plan(meta(build), "auto", tp=2)
    with pytest.raises(ValueError, match=r"attn has num_heads=4, which .* not divisible by tp=8"):
        resolve_plan(meta(build), "auto", tp=8)


def test_hidden_size_not_divisible_by_tp():
    with pytest.raises(ValueError) as err:
        resolve_plan(meta(lambda: plain_mlp(hidden=30)), "mlp", tp=4)
    assert "0 (Linear, colwise): out_features=30 is not divisible by tp=4" in str(err.value)
    assert "2 (Linear, rowwise): in_features=30 is not divisible by tp=4" in str(err.value)  # all problems at once


def test_pattern_matching_no_module():
    with pytest.raises(
        ValueError, match=r"plan pattern 'blocks\.\*\.attn\.query' \(colwise\) matches no module of GPT"
    ):
        resolve_plan(gpt(), {"blocks.*.attn.q": "colwise", "blocks.*.attn.query": "colwise"}, tp=2)


def test_module_given_two_styles():
    with pytest.raises(
        ValueError, match=r"module 'blocks.0.mlp.fc1' is given two styles: 'blocks\.\*\.mlp\.fc1' -> 'colwise'"
    ):
        resolve_plan(gpt(), {"blocks.*.mlp.fc1": "colwise", "blocks.0.mlp.*": "rowwise"}, tp=2)


def test_unsupported_module_types_for_a_style():
    with pytest.raises(
        ValueError,
        match=r"module 'blocks.0.norm1' is a LayerNorm; style 'colwise' supports only"
        r" \['Linear', 'Conv1D', 'Embedding'\]",
    ):
        resolve_plan(gpt(), {"blocks.0.norm1": "colwise"}, tp=2)
    with pytest.raises(ValueError, match=r"'blocks.0.attn.q' is a Linear; style 'sequence_parallel' supports only"):
        resolve_plan(gpt(), {"blocks.0.attn.q": "sequence_parallel"}, tp=2)
    with pytest.raises(
        ValueError, match=r"'tok_emb' is a Embedding; style 'colwise_gather' supports only \['Linear', 'Conv1D'\]"
    ):
        resolve_plan(gpt(), {"tok_emb": "colwise_gather"}, tp=2)


def test_bad_plan_values():
    with pytest.raises(ValueError, match=r"unknown style 'columnwise'"):
        resolve_plan(gpt(), {"lm_head": "columnwise"}, tp=2)
    with pytest.raises(ValueError, match=r"style 'sp_exit' takes no option\(s\) \['output'\]"):
        resolve_plan(gpt(), {"blocks.1": {"style": "sp_exit", "output": "replicate"}}, tp=2)
    with pytest.raises(ValueError, match=r"output='shard' is not a layout"):
        resolve_plan(gpt(), {"lm_head": {"style": "colwise", "output": "shard"}}, tp=2)
    with pytest.raises(ValueError, match=r"`tp=0` must be an integer >= 1"):
        resolve_plan(gpt(), "auto", tp=0)
    with pytest.raises(TypeError, match="must be a mapping"):
        resolve_plan(gpt(), ["lm_head"], tp=2)


def test_sequence_parallel_needs_a_plan_that_marks_sequence_regions():
    with pytest.raises(ValueError, match=r"sequence_parallel=True but the plan has no 'sp_enter'"):
        resolve_plan(meta(plain_mlp), "mlp", tp=2, sequence_parallel=True)


def test_tp_larger_than_devices_per_node_needs_opt_in():
    with pytest.raises(ValueError, match=r"`tp=4` is larger than devices_per_node=2"):
        MeshSpec(world_size=8, devices_per_node=2, tp=4)
    assert MeshSpec(world_size=8, devices_per_node=2, tp=4, allow_cross_node_tp=True).resolve().size("tp") == 4


# ---- the strategy ----------------------------------------------------------------------------------
def test_strategy_registration_and_options():
    assert StrategyRegistry["tp"]["strategy"] is TensorParallelStrategy
    assert StrategyRegistry.get("tp").sequence_parallel is False
    assert StrategyRegistry.get("tp_sp").sequence_parallel is True
    with pytest.raises(ValueError) as err:
        TensorParallelStrategy(tp=0, tp_plan="nope", sequence_parallel="yes")
    msg = str(err.value)
    assert "`tp=0` must be an integer >= 1" in msg and "`tp_plan='nope'`" in msg and "`sequence_parallel='yes'`" in msg


def test_strategy_tp_auto_is_devices_per_node_and_validates_before_collectives():
    strategy = TensorParallelStrategy(tp_plan="auto")
    strategy.parallel_devices = [torch.device("cpu")] * 4
    spec = strategy.mesh_spec()
    assert (spec.size("tp"), spec.size("dp")) == (4, 1)
    # the plan is checked against the module on every rank in setup_environment, before the mesh exists
    strategy.connect(Wrapped(GPT(n_layer=1, n_head=2, n_embd=16)))
    with pytest.raises(ValueError, match="has 2 heads, not divisible by tp=4"):
        strategy.validate_config(spec)
    strategy = TensorParallelStrategy(tp=2, dp_shard=2, zero_stage=1)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    with pytest.raises(ValueError, match="zero_stage=1 .* does not compose with tp=2"):
        strategy.validate_config(strategy.mesh_spec())


def test_a_plan_is_resolved_once_into_one_object():
    """resolve_tp_plan picks the built-in plan and resolves it; the result is what apply_tp and the strategy use."""
    from lightning_dist.parallelize.tp.plan import ResolvedPlan, resolve_tp_plan

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    resolved = resolve_tp_plan(model, "auto", tp=2)
    assert isinstance(resolved, ResolvedPlan) and resolved.name == "mlp" and resolved.tp == 2
    assert list(resolved.entries) == resolve_plan(model, "mlp", tp=2)
    assert resolve_tp_plan(model, resolved, tp=2) is resolved  # already resolved: passed along as it is
    custom = resolve_tp_plan(model, {"0": "colwise", "2": "rowwise"}, tp=2)
    assert custom.name == "custom" and [e.style for e in custom.entries] == ["colwise", "rowwise"]


def test_loss_parallel_needs_one_vocabulary_split_head_before_any_collective():
    """loss_parallel=True keeps the plan's one colwise_gather layer (the head) sharded: a plan without one (the MLP
    plan) or with several is refused by validate_config, before the mesh exists; the GPT's auto plan has one."""
    with pytest.raises(ValueError, match="`loss_parallel='yes'` must be True or False"):
        TensorParallelStrategy(loss_parallel="yes")
    strategy = TensorParallelStrategy(tp=2, loss_parallel=True)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.connect(Wrapped(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))))
    with pytest.raises(
        ValueError, match="loss_parallel=True .* exactly one layer, the output head, style 'colwise_gather'; it has 0"
    ):
        strategy.validate_config(strategy.mesh_spec())
    strategy = TensorParallelStrategy(tp=2, loss_parallel=True, tp_plan={"0": "colwise_gather", "2": "colwise_gather"})
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.connect(Wrapped(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))))
    with pytest.raises(ValueError, match=r"it has 2 \(\['model.0', 'model.2'\]\).*or pass loss_parallel=False"):
        strategy.validate_config(strategy.mesh_spec())
    strategy = TensorParallelStrategy(tp=2, loss_parallel=True)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.connect(Wrapped(GPT(n_layer=1, n_head=2, n_embd=16)))
    strategy.validate_config(strategy.mesh_spec())
    assert "loss_parallel=True" in repr(strategy)


def test_loss_parallel_guard_lets_only_cross_entropy_reach_the_logits():
    """LogitsGuard follows the head's logits through views, casts and slices: cross-entropy (and log_softmax +
    nll_loss) pass, metadata reads and detached copies pass, any other use is refused naming the call and the fix."""
    import torch.nn.functional as F

    from lightning_dist.parallelize.tp.loss import LogitsGuard

    logits, target = torch.randn(2, 3, 5, requires_grad=True), torch.randint(0, 5, (2, 3))

    def run(step):
        guard = LogitsGuard("model.head")
        guard.follow(logits)
        with guard:
            step(logits)
        return guard.served

    assert run(lambda z: F.cross_entropy(z.float().flatten(0, 1), target.flatten()))
    assert run(lambda z: F.nll_loss(F.log_softmax(z[:, :-1].reshape(-1, z.size(-1)), -1), target[:, :-1].flatten()))
    assert run(lambda z: (z.shape, z.device, z.detach().argmax(-1), F.cross_entropy(z.view(-1, 5), target.view(-1))))
    for bad, name in (
        (lambda z: F.mse_loss(z, torch.zeros_like(z)), "mse_loss"),
        (lambda z: z.softmax(-1), "softmax"),
        (lambda z: F.cross_entropy(z.view(-1, 5) * 2, target.view(-1)), "mul"),
    ):
        with pytest.raises(
            ValueError,
            match=f"loss_parallel=True keeps the logits of 'model.head' .* used them in .*{name}"
            ".*F.cross_entropy .* or pass loss_parallel=False",
        ):
            run(bad)


# ---- the split-flow rule and HuggingFace's own styles (one process) ------------------------------------------------
class _HeadNormAttention(nn.Module):
    """q/k projections split by heads, a norm on each head (Qwen3-style) or on the whole projection (OLMo 2-style)."""

    def __init__(self, per_head: bool, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.per_head = heads, per_head
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.q_norm = nn.RMSNorm(dim // heads if per_head else dim)
        self.gate = nn.Linear(dim, dim)  # runs on the region's whole input: never summed

    def forward(self, x):
        B, T, _ = x.shape
        shape = (B, T, -1, x.shape[-1] // self.heads)
        x = x + self.gate(x)
        q = self.q_norm(self.q(x).view(shape)) if self.per_head else self.q_norm(self.q(x)).view(shape)
        k, v = self.k(x).view(shape), self.v(x).view(shape)
        y = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class _HeadNormNet(nn.Module):
    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_HeadNormAttention(per_head) for _ in range(2))
        self.example_input_array = torch.randn(2, 4, 16)  # what the rule's forward runs on

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_split_flow_rule_sums_the_gradients_of_per_head_norms():
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    net = _HeadNormNet(per_head=True)
    resolved = resolve_tp_plan(
        net,
        {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise"},
        tp=2,
    )
    added = {e.fqn: e.pattern for e in resolved.entries if e.style == "replicate_grad_sum"}
    assert added == {f"layers.{i}.q_norm": "(rule) runs on split activations" for i in range(2)}, added
    assert resolved.flow_traced  # found by a forward on its example_input_array, not guessed
    # a style the user wrote is kept: 'replicate' on the norm leaves it to the setup self-check (no rule entry)
    user = resolve_tp_plan(
        net,
        {
            "layers.*.q": "colwise",
            "layers.*.k": "colwise",
            "layers.*.v": "colwise",
            "layers.*.o": "rowwise",
            "layers.*.q_norm": "replicate",
        },
        tp=2,
    )
    assert not any(e.style == "replicate_grad_sum" for e in user.entries)


def test_split_flow_rule_refuses_a_norm_across_the_split_dimension():
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    plan = {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise"}
    with pytest.raises(ValueError, match=r"layers.0.q_norm \(RMSNorm\) runs on the output of 'layers.0.q'.*spans 16"):
        resolve_tp_plan(_HeadNormNet(per_head=False), plan, tp=2)
    # the fix it names: the projection gathered, the row-wise layer split on entry (HuggingFace's plan for OLMo 2)
    fixed = dict(plan, **{"layers.*.q": "colwise_gather", "layers.*.o": {"style": "rowwise", "input": "replicate"}})
    fixed.update({"layers.*.k": "colwise_gather", "layers.*.v": "colwise_gather"})
    assert not any(e.style == "replicate_grad_sum" for e in resolve_tp_plan(_HeadNormNet(False), fixed, tp=2).entries)


class _NormPerHead(nn.Module):
    """One LayerNorm per head, paired with the heads by position (StableLM's q/k layernorm)."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim) for _ in range(heads))

    def forward(self, x):  # [B, H, T, D]
        return torch.cat([norm(h) for norm, h in zip(self.norms, torch.split(x, 1, dim=1))], dim=1)


class _ListNormAttention(_HeadNormAttention):
    def __init__(self) -> None:
        super().__init__(per_head=True)
        self.q_norm = _NormPerHead(self.heads, 4)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = torch.nn.functional.scaled_dot_product_attention(self.q_norm(q), k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def test_split_flow_rule_refuses_a_list_of_modules_one_per_head():
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    net = _HeadNormNet(per_head=True)
    net.layers = nn.ModuleList(_ListNormAttention() for _ in range(2))
    plan = {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise"}
    with pytest.raises(ValueError, match=r"layers.0.q_norm.norms holds one LayerNorm per slice of the split output of"):
        resolve_tp_plan(net, plan, tp=2)
    # the fix it names: the attention left whole (the rule adds nothing then)
    mlp_only = resolve_tp_plan(net, {"layers.*.gate": {"style": "colwise", "output": "replicate"}}, tp=2)
    assert not any(e.style == "replicate_grad_sum" for e in mlp_only.entries)
    transformers = pytest.importorskip("transformers")
    config = transformers.StableLmConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, qk_layernorm=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"self_attn.q_layernorm.norms holds one LayerNorm per slice"):
        resolve_tp_plan(transformers.StableLmForCausalLM(config), "auto", tp=2)


class _InPlaceResidual(nn.Module):
    """An MLP whose output is changed in place (Falcon's `mlp_output += attention_output`)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.side = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)
        self.example_input_array = torch.randn(2, 8)

    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))
        out += self.side(x)
        return out


def test_split_flow_rule_hands_a_copy_to_an_output_changed_in_place():
    from lightning_dist.parallelize.tp.flow import _in_place
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    resolved = resolve_tp_plan(_InPlaceResidual(), {"up": "colwise", "down": "rowwise"}, tp=2)
    assert {e.fqn: e.copy_output for e in resolved.entries} == {"up": False, "down": True}
    assert [
        n for n in ("__iadd__", "add_", "mul_", "__init__", "__iter__", "requires_grad_", "view") if _in_place(n)
    ] == [
        "__iadd__",
        "add_",
        "mul_",
    ]


def test_a_split_model_failing_where_the_unsplit_one_runs_is_refused_with_the_causes():
    from lightning_dist.parallelize.tp.probe import check_probe

    class Fails(nn.Module):
        def forward(self, x):
            raise RuntimeError("The expanded size of the tensor (4) must match the existing size (8)")

    with pytest.raises(
        ValueError,
        match=r"tp=2\): the split model fails on a probe sample the unsplit model takes"
        r" \(RuntimeError: The expanded size.*ALiBi.*in-place change",
    ):
        check_probe(Fails(), torch.zeros(2), torch.zeros(2), describe="tensor-parallel plan (tp=2)")


class _Float32Norm(nn.Module):
    """An RMSNorm that computes in float32 whatever the model's dtype, as most HF norms do."""

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


class _Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), norm, nn.Linear(16, 4)
        self.register_buffer("table", torch.arange(16.0))  # a constant: its float32 copy is not an activation
        self.example_input_array = torch.randn(2, 8, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)) + self.table.float().to(x.dtype))


def test_the_output_probe_allows_the_rounding_of_a_precision_the_model_computes_in():
    # a split moves float32's rounding inside a float64 model (HF Llama 4 text: 3.7e-8 at the output, exact with its
    # casts removed); its constants computed in float32 (a rotary table) are the same split or not and do not count
    from lightning_dist.parallelize.tp.probe import check_probe, probe_output

    net = _Net(_Float32Norm()).double()
    _, sample, out, inner = probe_output(net, torch.device("cpu"))
    assert inner == (torch.float32, "norm (_Float32Norm)")
    assert probe_output(_Net(nn.Identity()).double(), torch.device("cpu"))[3] is None
    describe = "tensor-parallel plan (tp=2)"
    assert check_probe(net, sample, out * (1 + 1e-7), inner, describe=describe) < 1e-6
    with pytest.raises(ValueError, match=r"relative difference 1\.000e-07 > 1e-09; output shape"):
        check_probe(net, sample, out * (1 + 1e-7), describe=describe)
    with pytest.raises(
        ValueError, match=r"> 1e-04, float32's as the model computes in it \(norm \(_Float32Norm\) first\)"
    ):
        check_probe(net, sample, out * 1.01, inner, describe=describe)


def test_split_flow_rule_traces_a_model_on_the_meta_device():
    from lightning_dist.parallelize.tp.plan import resolve_tp_plan

    with torch.device("meta"):
        net = _HeadNormNet(per_head=True)
    plan = {"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise"}
    resolved = resolve_tp_plan(net, plan, tp=2)
    assert resolved.flow_traced and sum(e.style == "replicate_grad_sum" for e in resolved.entries) == 2


def test_hf_styles_map_or_are_refused_by_name():
    transformers = pytest.importorskip("transformers")
    from lightning_dist.parallelize.tp.auto import HF_STYLES, hf_plan

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    olmo = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, eos_token_id=0))
    plan = hf_plan(olmo, tp=2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise_gather"  # its norms see the whole projection
    assert plan["model.layers.*.self_attn.o_proj"] == {"style": "rowwise", "input": "replicate"}
    qwen = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=8))
    assert hf_plan(qwen, tp=2)["model.layers.*.self_attn.q_norm"] == "replicate_grad_sum"
    # every style the installed transformers registers is mapped or refused with its reason
    styles = pytest.importorskip("transformers.distributed.tensor_parallel").ALL_PARALLEL_STYLES
    from lightning_dist.parallelize.tp.auto import HF_REFUSED

    unknown = set(styles.valid_keys()) - set(HF_STYLES) - set(HF_REFUSED)
    assert not unknown, unknown
    qwen._tp_plan = dict(qwen._tp_plan, **{"model.layers.*.mlp.gate_proj": "packed_colwise"})
    with pytest.raises(ValueError, match=r"'packed_colwise' \(a fused \[gate \| up\] weight"):
        hf_plan(qwen, tp=2)


def test_plan_is_the_former_name_of_tp_plan():
    """The same option has one name on every strategy (tp_plan); `plan=` still works for one release, with a warning."""
    with pytest.warns(DeprecationWarning, match="tp_plan='mlp'"):
        strategy = TensorParallelStrategy(plan="mlp")
    assert strategy.tp_plan == "mlp"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not both"):
        TensorParallelStrategy(plan="mlp", tp_plan="transformer")
