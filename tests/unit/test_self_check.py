"""The self-checks' probe samples (``lightning_dist/parallelize/self_check.py``) in one process."""

from __future__ import annotations

from collections import UserDict, namedtuple

import torch
from torch import nn

from lightning_dist.parallelize.self_check import probe_samples


def test_probe_samples_cast_the_tensors_of_any_container():
    # floating tensors to the parameters' dtype, integer ones kept; dicts, lists, tuples, namedtuples walked, a mapping
    # pytree does not walk (HF's BatchEncoding is a UserDict) read as a dict, anything else as it is
    Pair = namedtuple("Pair", "x ids")
    net = nn.Linear(3, 2).double()
    x, ids = torch.randn(2, 3), torch.arange(2)
    samples = [
        x,
        (x, ids, "tag"),
        [x, None],
        {"x": x, "more": [ids, (x,)]},
        UserDict(x=x, ids=ids),
        Pair(x, ids),
    ]
    cast = []
    for sample in samples:
        net.example_input_array = sample
        ((got_net, got),) = probe_samples(net)
        assert got_net is net
        cast.append(got)
    assert cast[0].dtype == torch.float64 and torch.equal(cast[0], x.double())
    assert isinstance(cast[1], tuple) and cast[1][0].dtype == torch.float64
    assert cast[1][1].dtype == torch.int64 and cast[1][2] == "tag"
    assert isinstance(cast[2], list) and cast[2][0].dtype == torch.float64 and cast[2][1] is None
    assert cast[3]["x"].dtype == torch.float64 and cast[3]["more"][0].dtype == torch.int64
    assert cast[3]["more"][1][0].dtype == torch.float64
    assert type(cast[4]) is dict and cast[4]["x"].dtype == torch.float64 and cast[4]["ids"].dtype == torch.int64
    assert isinstance(cast[5], Pair) and cast[5].x.dtype == torch.float64 and cast[5].ids.dtype == torch.int64


def test_the_unsplit_copies_run_as_the_split_forward_did_in_eval_mode():
    """A block with dropout: the split forward runs in eval mode, so must its unsplit copy (else every model with
    dropout, GPT-2's default config among them, was refused with a ~0.5 relative difference)."""
    from lightning_dist.parallelize.self_check import check_split_model, run_eval

    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(2)))
    model = nn.Sequential(nn.Linear(4, 8), blocks, nn.Linear(8, 2)).double().train()
    x = torch.randn(3, 4, dtype=torch.float64)
    report = check_split_model(
        model, lambda: run_eval(model, x, grad=True), list(blocks.named_children()), describe="test"
    )
    assert report.blocks == 2 and report.worst < 1e-12, report
    assert model.training  # left in the mode it was in
