"""ResumableDataLoader and ResumeRNG in one process."""

import random

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_dist.callbacks import ResumeRNG
from lightning_dist.data import ResumableDataLoader


class CountingDataset(TensorDataset):
    def __init__(self, n):
        super().__init__(torch.arange(n))
        self.loaded = []

    def __getitem__(self, i):
        self.loaded.append(i)
        return super().__getitem__(i)


def _loader(data, epoch):
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(epoch)
    return ResumableDataLoader(data, batch_size=2, sampler=sampler)


def test_resume_mid_pass_continues_the_same_order_without_loading_skipped_samples():
    full = [b[0].tolist() for b in _loader(CountingDataset(20), epoch=1)]
    first = _loader(CountingDataset(20), epoch=1)
    it = iter(first)
    head = [next(it)[0].tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"position": 3} and head == full[:3]

    data = CountingDataset(20)
    resumed = _loader(data, epoch=1)
    resumed.load_state_dict(state)
    tail = [b[0].tolist() for b in resumed]
    assert tail == full[3:]
    assert sorted(data.loaded) == sorted(i for b in full[3:] for i in b)  # skipped by index, never loaded
    assert resumed.state_dict() == {"position": len(full)}
    assert [b[0].tolist() for b in resumed] == full  # the next pass starts from the beginning again


def test_state_saved_at_the_end_of_a_pass_skips_nothing():
    loader = _loader(CountingDataset(20), epoch=0)
    loader.load_state_dict({"position": len(loader)})
    assert len(list(loader)) == len(loader)


def test_resume_rng_round_trip_single_process():
    callback = ResumeRNG()
    torch.manual_seed(5)
    random.seed(5)
    state = callback.state_dict()
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    callback.load_state_dict(state)
    callback.on_train_start(None, None)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    # the saved state loads with weights_only=True (no pickled classes)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
