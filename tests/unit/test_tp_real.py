"""Tensor parallelism on real models, in one process: tied weights, plans checked against shapes, tp_plan="auto"
from a HuggingFace model's own plan or its structure, and the refusals (meta-device models, no process group)."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.callbacks import GradientParityCheck, GradientParityError
from lightning_dist.models import GPT
from lightning_dist.parallelize.fsdp import _refuse_split_ties
from lightning_dist.parallelize.shared import check_shared_units, shared_parameters
from lightning_dist.parallelize.tp.auto import builtin_plan
from lightning_dist.parallelize.tp.plan import format_plan, resolve_plan

tf = pytest.importorskip("transformers")


def meta(build):
    with torch.device("meta"):
        return build()


def gpt2():
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0, eos_token_id=0)
    return meta(lambda: tf.GPT2LMHeadModel(cfg))


def qwen2(kv: int = 2):
    cfg = tf.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
    )
    return meta(lambda: tf.Qwen2ForCausalLM(cfg))


class Wrapped(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


# ---- tied weights ----------------------------------------------------------------------------------
def test_shared_parameters_lists_every_name_of_a_tied_tensor():
    assert shared_parameters(gpt2()) == [("transformer.wte.weight", "lm_head.weight")]
    layer = nn.Linear(3, 3)
    assert shared_parameters(nn.Sequential(layer, nn.Tanh(), layer)) == [("0.weight", "2.weight"), ("0.bias", "2.bias")]


def test_auto_plan_makes_a_tied_embedding_vocab_parallel():
    for model, emb, head in (
        (gpt2(), "transformer.wte", "lm_head"),
        (meta(lambda: GPT(n_layer=2, n_head=4, n_embd=32, tie_weights=True)), "tok_emb", "lm_head"),
    ):
        styles = {e.fqn: e.style for e in resolve_plan(model, "auto", tp=2)}
        assert styles[emb] == "rowwise" and styles[head] == "colwise_gather"  # both split on the vocabulary (dim 0)


def test_plan_breaking_a_tie_is_refused_with_names_and_fix():
    # the silent cases: GPT-2 with a head-only plan (0.226), the pack's tied GPT with the head only (4.4e-3)
    for model, plan, names in (
        (gpt2(), {"lm_head": "colwise_gather"}, "['transformer.wte.weight', 'lm_head.weight']"),
        (
            meta(lambda: GPT(n_layer=1, n_head=2, n_embd=16, tie_weights=True)),
            {"lm_head": "colwise_gather"},
            "['tok_emb.weight', 'lm_head.weight']",
        ),
        (
            gpt2(),
            {
                "transformer.wte": "colwise",
                "lm_head": "colwise_gather",
                "transformer.h.*.mlp.c_fc": "colwise",
                "transformer.h.*.mlp.c_proj": "rowwise",
            },
            "transformer.wte.weight: split on dim 1",
        ),
    ):
        with pytest.raises(ValueError) as err:
            resolve_plan(model, plan, tp=2)
        msg = str(err.value)
        assert names in msg and "train apart" in msg and "vocab-parallel" in msg, msg


def test_tied_parameters_in_two_fsdp_units_are_refused():
    layer = nn.Linear(4, 4)
    model = nn.Module()
    model.net = nn.Module()
    model.net.layers = nn.ModuleList([nn.Sequential(layer), nn.Sequential(nn.Linear(4, 4), layer)])
    with pytest.raises(
        ValueError, match=r"lie in different sharding units .*net\.layers\.0\.0\.weight in 'net\.layers\.0'"
    ):
        _refuse_split_ties(model, ["net.layers.0", "net.layers.1"])
    assert check_shared_units(shared_parameters(model), ["net"]) == []  # one root holds both: fine


class TiedModel(pl.LightningModule):
    def __init__(self, break_tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.break_tie = break_tie

    def on_fit_start(self):
        if self.break_tie:  # what a strategy that re-registers the head's weight does, after the callback's setup
            self.head.weight = nn.Parameter(self.emb.weight.detach().clone())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randint(0, 8, (8, 3), generator=g), torch.randint(0, 8, (8, 3), generator=g)),
            batch_size=4,
        )


@pytest.mark.parametrize("break_tie", [False, True], ids=["tied", "tie-broken"])
def test_gradient_parity_keeps_ties_as_the_user_built_them(break_tie):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[check := GradientParityCheck(steps=(0,))],
    )
    if not break_tie:  # no false alarm on a correctly trained tied model
        trainer.fit(TiedModel())
        assert check.results[0]["ok"] and check.results[0]["rel_diff"] <= 1e-12
        return
    with pytest.raises(GradientParityError, match="relative gradient difference"):
        trainer.fit(TiedModel(break_tie=True))


# ---- plans checked against the model ------------------------------------------------------------
def test_wrong_plans_are_refused_naming_the_layer():
    model = meta(lambda: GPT(n_layer=2, n_head=4, n_embd=32))
    with pytest.raises(
        ValueError, match=r"blocks\.0\.mlp\.fc2 \(Linear, rowwise\) expects an input split .* no column-wise"
    ):
        resolve_plan(model, {"blocks.*.mlp.fc2": "rowwise"}, tp=2)  # was: mat1 and mat2 shapes cannot be multiplied
    with pytest.raises(ValueError, match=r"lm_head \(Linear, colwise\) leaves its output split .* 'colwise_gather'"):
        resolve_plan(model, {"lm_head": "colwise"}, tp=2)  # was: Target 25 is out of bounds
    # stated layouts are taken as the user's word
    resolve_plan(
        model,
        {
            "lm_head": {"style": "colwise", "output": "replicate"},
            "blocks.*.mlp.fc2": {"style": "rowwise", "input": "replicate"},
        },
        tp=2,
    )


def test_gqa_key_value_heads_must_divide_by_tp():
    resolve_plan(qwen2(kv=2), "auto", tp=2)
    with pytest.raises(ValueError, match=r"k_proj: the attention module has 2 key/value heads, not divisible by tp=4"):
        resolve_plan(qwen2(kv=2), "auto", tp=4)


def test_head_count_attribute_must_divide_by_tp():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head = 3
            self.q, self.k, self.v, self.o = (nn.Linear(12, 12) for _ in range(4))

    with pytest.raises(
        ValueError,
        match=r"Attn has n_head=3, which the plan must set to the local count n_head // tp on each rank,"
        r" but 3 is not divisible",
    ):
        resolve_plan(meta(Attn), {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}, tp=2)


def test_head_counts_in_a_shared_config_get_a_local_copy():
    from types import SimpleNamespace

    from lightning_dist.parallelize.tp.checks import GLOBAL_ATTRS_KEY, set_local_attrs

    class Attn(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config  # litgpt style: shared by every layer
            self.q, self.k, self.v, self.o = (nn.Linear(12, 12) for _ in range(4))

    plan = {"*.q": "colwise", "*.k": "colwise", "*.v": "colwise", "*.o": "rowwise"}
    with pytest.raises(ValueError, match=r"has config.n_head=3, which the plan must set to the local count"):
        resolve_plan(meta(lambda: nn.ModuleList([Attn(SimpleNamespace(n_head=3))])), plan, tp=2)
    shared = SimpleNamespace(n_head=4, n_query_groups=2, head_size=3)
    net = meta(lambda: nn.ModuleList([Attn(shared), Attn(shared)]))
    set_local_attrs(net, resolve_plan(net, plan, tp=2), 2)
    assert (net[0].config.n_head, net[0].config.n_query_groups, net[0].config.head_size) == (2, 1, 3)
    assert net[0].config is not shared and shared.n_head == 4  # the shared config keeps the global counts
    assert net[1].__dict__[GLOBAL_ATTRS_KEY]["config"] is shared  # what single-device copies restore


def test_patterns_match_from_the_root():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.decoder = nn.Linear(4, 4)
            self.decoder = nn.Linear(4, 8)

    net = meta(Net)
    # `decoder` is the top-level layer only, never also `transformer.decoder` (the nn.Transformer case)
    assert [e.fqn for e in resolve_plan(net, {"decoder": "colwise_gather"}, tp=2)] == ["decoder"]
    assert [e.fqn for e in resolve_plan(Wrapped(net), {"decoder": "colwise_gather"}, tp=2)] == ["model.decoder"]
    with pytest.raises(
        ValueError, match=r"only names deeper paths \['inner\.transformer\.decoder'\]: write the full path"
    ):
        resolve_plan(_outer(net), {"transformer.decoder": "colwise_gather"}, tp=2)
    wrapped = Wrapped(meta(Net))
    wrapped.decoder = meta(lambda: nn.Linear(4, 8))  # `decoder` from the LightningModule and from `model`
    with pytest.raises(
        ValueError, match=r"'decoder' .* has no wildcard but matches 2 paths \['model\.decoder', 'decoder'\]"
    ):
        resolve_plan(wrapped, {"decoder": "colwise_gather"}, tp=2)


def _outer(net):
    outer = nn.Module()
    outer.inner = net  # `transformer.decoder` is now `inner.transformer.decoder`
    return outer


# ---- tp_plan="auto" for real models ----------------------------------------------------------------
def test_auto_uses_the_hf_models_own_plan():
    name, plan = builtin_plan(qwen2(), "auto", tp=2)
    assert name == "hf"
    assert plan["model.embed_tokens"] == "rowwise" and plan["lm_head"] == "colwise_gather"
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    model = qwen2()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(
        ValueError, match=r"style\(s\) the pack does not implement: 'model.layers.\*.mlp.up_proj': 'packed_colwise'"
    ):
        builtin_plan(model, "hf", tp=2)


def test_auto_reads_the_structure_of_gpt2_and_splits_conv1d():
    model = gpt2()
    name, plan = builtin_plan(model, "auto", tp=2)
    assert name == "transformer"
    assert plan["transformer.h.*.mlp.c_fc"] == "colwise" and plan["transformer.h.*.mlp.c_proj"] == "rowwise"
    # [q|k|v] blocks, not head-major: split per head, the attention's output projection row-wise
    assert plan["transformer.h.*.attn.c_attn"] == "colwise_qkv" and plan["transformer.h.*.attn.c_proj"] == "rowwise"
    assert plan["transformer.wte"] == "rowwise" and plan["lm_head"] == "colwise_gather"  # tied: vocab-parallel
    text = format_plan(resolve_plan(model, "auto", tp=2), tp=2)
    row = next(line for line in text.splitlines() if "transformer.h.0.mlp.c_fc" in line)
    assert "Conv1D" in row and "weight 32x128, bias 128" in row and "weight 32x64, bias 64" in row
    # its blocks take masks and caches besides the hidden states: no sequence-parallel entries, a clear refusal
    with pytest.raises(ValueError, match="adds them only for blocks whose forward takes the hidden states alone"):
        resolve_plan(model, "auto", tp=2, sequence_parallel=True)


def test_auto_on_lightnings_demo_transformer_splits_its_mlps():
    from lightning.pytorch.demos import Transformer

    model = meta(lambda: Transformer(vocab_size=64, ninp=32, nhead=4, nhid=64, nlayers=2))
    name, plan = builtin_plan(Wrapped(model), "auto", tp=2)
    assert name == "transformer"
    assert plan["model.transformer.encoder.layers.*.linear1"] == "colwise"
    assert plan["model.transformer.decoder.layers.*.linear2"] == "rowwise"
    assert plan["model.decoder"] == "colwise_gather"  # the output head; never also transformer.decoder
    styles = {e.fqn: e.style for e in resolve_plan(Wrapped(model), plan, tp=2)}
    assert "model.transformer.decoder" not in styles and styles["model.decoder"] == "colwise_gather"


def test_auto_refuses_and_suggests_a_plan():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(4, 8), nn.Conv1d(8, 8, 1), nn.Linear(8, 4)
            self.pair = nn.Module()
            self.pair.up, self.pair.down = nn.Linear(4, 16), nn.Linear(16, 4)

    with pytest.raises(ValueError) as err:
        builtin_plan(meta(Odd), "auto", tp=2)
    msg = str(err.value)
    assert "No built-in tensor-parallel plan matches Odd" in msg
    assert "A plan to start from" in msg and "  pair.up: colwise\n  pair.down: rowwise" in msg


# ---- HuggingFace weights in one process -----------------------------------------------------------
def test_hf_weights_load_into_an_empty_model_and_refuse_mismatches(tmp_path):
    from safetensors.torch import load_file

    from lightning_dist.hf import init_empty_weights, load_hf_weights, restore_buffers, save_buffers, save_hf_pretrained

    cfg = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "src"))
    with init_empty_weights():
        model = Wrapped(tf.LlamaForCausalLM(cfg))
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    buffers = save_buffers(model)
    model.to_empty(device="cpu")  # what the strategy's materialization does
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra'\]"):
        import shutil

        from safetensors.torch import save_file

        shutil.copytree(tmp_path / "src", tmp_path / "extra")
        save_file({"extra": torch.zeros(1)}, str(tmp_path / "extra" / "more.safetensors"))
        load_hf_weights(model, tmp_path / "extra")
    restore_buffers(model, buffers)
    assert sorted(load_hf_weights(model, tmp_path / "src")) == sorted(
        load_file(str(tmp_path / "src" / "model.safetensors"))
    )
    src = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert all(torch.equal(model.model.get_parameter(k), v) for k, v in src.items())
    save_hf_pretrained(model, tmp_path / "out")
    back = tf.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(back.get_parameter(k), v) for k, v in src.items())
    with pytest.raises(FileExistsError):
        save_hf_pretrained(model, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not a folder of .safetensors"):
        load_hf_weights(model, tmp_path / "nothing")
    with torch.device("meta"):
        fully_meta = Wrapped(tf.LlamaForCausalLM(cfg))
    with pytest.raises(
        ValueError,
        match=r"still on the meta device and are not stored in the folder; build the model under"
        r" .lightning_dist.hf.init_empty_weights",
    ):
        load_hf_weights(fully_meta, tmp_path / "src")


def test_fused_qkv_split_checks_heads_and_blocks():
    model = gpt2()
    text = format_plan(resolve_plan(model, "auto", tp=2), tp=2)
    row = next(line for line in text.splitlines() if "transformer.h.0.attn.c_attn" in line)
    # global: the model's [in, 3E]; local: what named_parameters() holds per rank, [in, 3, E/tp] (and says so)
    assert "colwise_qkv" in row and "weight 32x96, bias 96" in row and "weight 32x3x16, bias 3x16" in row
    assert "held as [in, 3, E/tp]" in " ".join(text.split()) and "keep the model's [in, 3E]" in " ".join(text.split())
    assert "held as" not in format_plan(
        resolve_plan(model, {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}, tp=2),
        tp=2,
    )
    with pytest.raises(ValueError, match=r"c_attn: the attention module has 4 heads, not divisible by tp=8"):
        resolve_plan(model, "auto", tp=8)
    with pytest.raises(ValueError, match=r"mlp.c_fc \(Conv1D, colwise_qkv\): 128 output features are not three equal"):
        resolve_plan(model, {"transformer.h.0.mlp.c_fc": "colwise_qkv", "transformer.h.0.mlp.c_proj": "rowwise"}, tp=2)


@pytest.mark.parametrize("kind", ["conv1d", "linear"])
def test_fused_qkv_layer_unsplit_copy_computes_the_original_layer(kind):
    """GradientParityCheck's single-device copy holds the whole [in, 3, E] (Conv1D) or [3, E, in] (Linear) tensors
    of a layer split per head: its forward must equal the original layer's, with the original layout."""
    import types

    from lightning_dist.parallelize.tp.styles import FUSED_SHAPES_KEY, fused_qkv_forward
    from lightning_dist.parallelize.tp.vocab import is_conv1d

    torch.manual_seed(0)
    layer = tf.pytorch_utils.Conv1D(24, 8) if kind == "conv1d" else nn.Linear(8, 24)
    x = torch.randn(2, 5, 8)
    expected = layer(x)
    dim = 1 if kind == "conv1d" else 0
    layer.__dict__[FUSED_SHAPES_KEY] = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    for n, p in list(layer.named_parameters()):
        d = dim if n == "weight" else 0
        shape = (*p.shape[:d], 3, p.shape[d] // 3, *p.shape[d + 1 :])
        layer.register_parameter(n, nn.Parameter(p.detach().reshape(shape)))
    layer.forward = types.MethodType(fused_qkv_forward, layer)  # as FusedQKVParallel binds it
    assert is_conv1d(layer) == (kind == "conv1d")  # still recognized with its fused forward
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


class _TwoInputAttention(nn.Module):
    """An attention whose forward takes more than its input (litgpt's: x, cos, sin, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, cos, sin, mask=None):
        return self.o(self.q(x) * cos + sin)


def test_one_input_styles_on_a_multi_input_forward_are_refused_naming_module_inputs_and_fix():
    # torch's PrepareModuleInput would fail at the first forward ("module inputs and input_layouts should have
    # same length!"), after the weights were distributed; the plan check refuses it first, in one process
    model = nn.Sequential(_TwoInputAttention())
    plan = {"0": "region_input", "0.q": "colwise", "0.o": "rowwise"}
    with pytest.raises(ValueError) as err:
        resolve_plan(model, plan, tp=2)
    msg = str(err.value)
    assert "- 0 (_TwoInputAttention) is given 'region_input'" in msg and "['x', 'cos', 'sin']" in msg, msg
    assert "same length" in msg and "Drop the '0' entry" in msg, msg
    for style in ("sp_enter", "sp_region"):  # every style that lays out exactly one input
        with pytest.raises(ValueError, match=f"given '{style}', which lays out exactly one input"):
            resolve_plan(model, {"0": style, "0.q": "colwise", "0.o": "rowwise"}, tp=2, sequence_parallel=True)
    # the same split without the one-input entry is accepted (the column-wise layer takes the replicated input)
    assert {e.style for e in resolve_plan(model, {"0.q": "colwise", "0.o": "rowwise"}, tp=2)} == {"colwise", "rowwise"}


def _litgpt(n_query_groups: int, mlp: str = "GptNeoxMLP"):
    try:  # installed with --no-deps (make install): on an old torch its import may fail in other ways than ImportError
        import litgpt
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"litgpt is not importable ({type(err).__name__}: {err}); make install adds it with --no-deps")
    cfg = litgpt.Config(
        block_size=8,
        vocab_size=64,
        padded_vocab_size=64,
        n_layer=2,
        n_head=4,
        n_embd=32,
        n_query_groups=n_query_groups,
        rotary_percentage=1.0,
        bias=False,
        mlp_class_name=mlp,
        intermediate_size=64,
    )
    return meta(lambda: litgpt.GPT(cfg))


@pytest.mark.parametrize("mlp", ["GptNeoxMLP", "LLaMAMLP"])
def test_auto_plan_on_litgpt_mha_splits_qkv_per_head_and_its_mlp(mlp):
    entries = {e.fqn: e.style for e in resolve_plan(_litgpt(4, mlp), "auto", tp=2)}
    mlp_cols = ["fc"] if mlp == "GptNeoxMLP" else ["fc_1", "fc_2"]
    for i in range(2):
        h = f"transformer.h.{i}"
        assert entries[f"{h}.attn.qkv"] == "colwise_qkv" and entries[f"{h}.attn.proj"] == "rowwise", entries
        assert all(entries[f"{h}.mlp.{c}"] == "colwise" for c in mlp_cols) and entries[f"{h}.mlp.proj"] == "rowwise"
        assert f"{h}.attn" not in entries  # forward(x, cos, sin, ...): no region_input there
        assert entries[f"{h}.mlp"] == "region_input"  # forward(x): one input
    assert entries["lm_head"] == "colwise_gather"
    assert not any(s.startswith("sp_") or s == "sequence_parallel" for s in entries.values())


def test_auto_plan_on_litgpt_gqa_is_refused_naming_the_layout():
    with pytest.raises(ValueError) as err:
        resolve_plan(_litgpt(2, "LLaMAMLP"), "auto", tp=2)
    msg = str(err.value)
    assert "CausalSelfAttention.qkv is a fused [q | k | v] projection with n_head=4 and n_query_groups=2" in msg, msg
    assert "Use n_query_groups == n_head" in msg, msg
