"""Checkpoint module in one process: atomic writes, key layouts, mismatch messages, safe loading."""

import os

import pytest
import torch
from torch import nn

from lightning_dist import checkpoint as ckpt


def test_atomic_file_save_keeps_the_previous_checkpoint_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt.save({"state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, path, sharded=False)
    good = path.read_bytes()

    def crash(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise OSError("disk died mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk died"):
        ckpt.save({"state_dict": {"w": torch.zeros(3)}, "optimizer_states": []}, path, sharded=False)
    assert path.read_bytes() == good  # the last good checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind


def test_directory_swap_falls_back_to_old_when_interrupted(tmp_path):
    path = tmp_path / "ck"
    old = tmp_path / "ck.old"
    old.mkdir()
    (old / "meta.pt").write_bytes(b"x")
    # a crash between the two renames leaves only `ck.old`: loading finds it
    assert ckpt.resolve_path(path) == old
    new = tmp_path / "ck.tmp"
    new.mkdir()
    ckpt._swap_in(new, path)
    assert path.is_dir() and not old.exists() and not new.exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.resolve_path(tmp_path / "missing")


def test_optimizer_key_layouts_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fqn = get_optimizer_state_dict(model, opt)
    index = ckpt.fqn_to_index(fqn)
    plain = opt.state_dict()
    assert [g["params"] for g in index["param_groups"]] == [g["params"] for g in plain["param_groups"]]
    for i, s in plain["state"].items():
        assert torch.equal(index["state"][i]["exp_avg"], s["exp_avg"])
    back = ckpt.index_to_fqn(plain, fqn)
    assert back["state"].keys() == fqn["state"].keys()
    with pytest.raises(ValueError, match="different model"):
        ckpt.index_to_fqn({"state": {}, "param_groups": [{"params": [0]}]}, fqn)


def test_mismatched_model_names_first_parameter_and_shapes(tmp_path):
    src, dst = nn.Sequential(nn.Linear(3, 4)), nn.Sequential(nn.Linear(3, 5))
    path = tmp_path / "m.ckpt"
    ckpt.save({"state_dict": src.state_dict(), "optimizer_states": []}, path, sharded=False)
    with pytest.raises(ValueError, match=r"Parameter '0.weight' has shape \[4, 3\] in the checkpoint but \[5, 3\]"):
        ckpt.load(path, model=dst)
    with pytest.raises(ValueError, match="no entry for parameter '1.weight'"):
        ckpt.load(path, model=nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4)))


def test_full_checkpoint_loads_into_a_plain_model(tmp_path):
    src, dst = nn.Linear(3, 4), nn.Linear(3, 4)
    path = tmp_path / "m.ckpt"
    ckpt.save({"state_dict": src.state_dict(), "optimizer_states": [], "global_step": 7}, path, sharded=False)
    rest = ckpt.load(path, model=dst)
    assert rest["global_step"] == 7
    assert torch.equal(dst.weight, src.weight)


def test_loading_refuses_pickled_objects_by_default(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Evil()}, path)
    with pytest.raises(RuntimeError, match="weights_only=True"):
        ckpt.load(path, model=nn.Linear(1, 1), strict=False)


def test_flattened_optimizer_layout_converts_to_torch_index_layout():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    nested = ckpt.unflatten_optimizer(flat, list(model.state_dict()))
    index = ckpt.fqn_to_index(nested)
    fresh = torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight]},
            {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0},
        ],
        lr=0.1,
    )
    fresh.load_state_dict(index)  # torch's own loader accepts it
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.01, 0.0]


# ---- completeness of a sharded checkpoint (issue 20): each damage named, before anything is read ----
def _sharded(path):
    ckpt.save(
        {"state_dict": {"w": torch.arange(6.0), "b": torch.ones(2)}, "optimizer_states": [], "epoch": 1},
        path,
        sharded=True,
    )
    return path


def _zero(file):
    file.write_bytes(bytes(file.stat().st_size))


DAMAGE = {
    "shard-missing": (lambda d: (d / "__0_0.distcp").unlink(), ["__0_0.distcp is missing"]),
    "shard-truncated": (
        lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
        ["__0_0.distcp is truncated (100 bytes"],
    ),
    "shard-zeroed": (lambda d: _zero(d / "__0_0.distcp"), ["__0_0.distcp is damaged", "is not a saved tensor"]),
    "meta-missing": (lambda d: (d / "meta.pt").unlink(), ["meta.pt (Lightning's loop state) is missing"]),
    "meta-zeroed": (lambda d: _zero(d / "meta.pt"), ["meta.pt (Lightning's loop state) is damaged"]),
    "index-missing": (lambda d: (d / ".metadata").unlink(), ["no `.metadata` file", "meta.pt"]),
    "index-zeroed": (lambda d: _zero(d / ".metadata"), [".metadata is damaged"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_sharded_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    folder = _sharded(tmp_path / "ck")
    ckpt.check_sharded(folder)  # intact: passes
    hurt, needles = DAMAGE[damage]
    hurt(folder)
    model = nn.Module()
    model.w, model.b = nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(2))
    for call in (
        lambda: ckpt.load(folder, model=model),
        lambda: ckpt.consolidate(folder, tmp_path / "one.ckpt"),
        lambda: ckpt.load_stage(folder, model=model),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert all(n in message for n in needles), (needles, message)
        assert str(folder) in message and "Copy the whole checkpoint directory again" in message
        assert "weights_only=False" not in message
    assert not (tmp_path / "one.ckpt").exists()


def test_consolidate_cli_on_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    from lightning_dist.cli import main

    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(tmp_path), str(tmp_path / "out.ckpt")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "is not a sharded checkpoint" in err and "no `.metadata` file" in err and "notes.txt" in err
    with pytest.raises(SystemExit) as info:
        main(["consolidate", str(tmp_path / "absent"), str(tmp_path / "out.ckpt")])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_damaged_single_file_checkpoint_is_named(tmp_path):
    path = tmp_path / "one.ckpt"
    ckpt.save({"state_dict": {"w": torch.ones(3)}, "optimizer_states": []}, path, sharded=False)
    good = path.read_bytes()
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3))
    for damaged in (good[:40], bytes(len(good))):  # truncated, zeroed
        path.write_bytes(damaged)
        with pytest.raises(ValueError, match="one.ckpt is damaged") as info:
            ckpt.load(path, model=model)
        assert "weights_only=False" not in str(info.value)


def test_a_tied_weight_saved_once_loads_into_every_copy_and_consolidates_to_every_name(tmp_path):
    """Pipeline checkpoints hold a weight tied across stages once (issue 14): a stage holding the copy under
    another name reads it through the alias, and consolidation gives every name of the plain model one tensor."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    whole[1].weight = whole[0].weight
    sd = whole.state_dict()
    path = tmp_path / "tied.ckpt"
    ckpt.save(
        {
            "state_dict": {k: sd[k] for k in ("0.weight", "0.bias", "1.bias")},
            "optimizer_states": [],
            ckpt.TIED_KEY: {"1.weight": "0.weight"},
        },
        path,
        sharded=True,
    )
    last = nn.Sequential(nn.Identity(), nn.Linear(3, 3))  # the last stage: the tied copy under the head's name
    ckpt.load_stage(path, model=last, aliases={"1.weight": "0.weight"})
    assert torch.equal(last[1].weight, whole[0].weight) and torch.equal(last[1].bias, whole[1].bias)
    with pytest.raises(ValueError, match="no entry"):  # without the alias the copy has nothing to load
        ckpt.load_stage(path, model=nn.Sequential(nn.Identity(), nn.Linear(3, 3)))
    ckpt.consolidate(path, tmp_path / "one.pt")
    full = torch.load(tmp_path / "one.pt", map_location="cpu", weights_only=True)
    state = full["state_dict"]
    assert ckpt.TIED_KEY not in full
    assert state["1.weight"].untyped_storage().data_ptr() == state["0.weight"].untyped_storage().data_ptr()
    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    plain[1].weight = plain[0].weight
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain[1].weight, whole[0].weight)


def test_a_pipeline_checkpoint_resumes_under_a_data_parallel_strategy(tmp_path):
    """A pipeline checkpoint keys its optimizer state by parameter name (``param_groups.<name>.lr``) and holds a
    weight tied across stages once; ``load`` (what hsdp/tp resume with) reads both into the plain model and its
    optimizer (issue 29: was ``Missing key in checkpoint state_dict: optimizer_0.param_groups.0.lr``)."""
    from lightning_dist.parallelize.pipeline.tied import save_tied_once

    def tied_net():
        net = nn.Module()
        net.emb, net.mid, net.head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False)
        net.head.weight = net.emb.weight
        return net

    def run(net, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            net.head(net.mid(net.emb(torch.tensor([[1, 2, 3]])))).square().sum().backward()
            opt.step()

    torch.manual_seed(0)
    net = tied_net()
    opt = torch.optim.AdamW([{"params": [net.emb.weight]}, {"params": net.mid.parameters(), "lr": 0.02}], lr=0.01)
    run(net, opt, 2)
    keys = [("emb.weight", ("emb.weight", "head.weight"), True)]  # what the pipeline stages save of the tied weight
    path = tmp_path / "pipe.ckpt"
    ckpt.save(
        {
            "state_dict": save_tied_once(ckpt.model_state(net, full=False), keys),
            "optimizer_states": [save_tied_once(ckpt.name_keyed_optimizer_state(net, opt), keys, optimizer=True)],
            ckpt.TIED_KEY: {"head.weight": "emb.weight"},
            "epoch": 3,
        },
        path,
        sharded=True,
    )

    torch.manual_seed(1)
    other = tied_net()
    other_opt = torch.optim.AdamW(
        [{"params": [other.emb.weight]}, {"params": other.mid.parameters(), "lr": 0.02}], lr=0.01
    )
    meta = ckpt.load(path, model=other, optimizers=[other_opt])
    assert meta["epoch"] == 3
    assert other.head.weight is other.emb.weight
    for (name, p), q in zip(net.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][slot], other_opt.state[q][slot]), (name, slot)
    assert [g["lr"] for g in other_opt.param_groups] == [0.01, 0.02]
    run(net, opt, 1), run(other, other_opt, 1)  # the resumed run takes the same next step
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), other.parameters()))


def test_a_pipeline_checkpoint_with_another_optimizer_is_refused_naming_the_entry(tmp_path):
    net = nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    path = tmp_path / "pipe.ckpt"
    ckpt.save(
        {
            "state_dict": ckpt.model_state(net, full=False),
            "optimizer_states": [ckpt.name_keyed_optimizer_state(net, opt)],
        },
        path,
        sharded=True,
    )
    with pytest.raises(ValueError, match=r"no optimizer entry '[^']+' \(of \d+ missing\).*same model and optimizers"):
        ckpt.load(path, model=net, optimizers=[torch.optim.Adam(net.parameters())])
