"""GlobalBatchSampler: epoch permutations, dp slicing, exact resume across dp sizes; val_batches."""

import pytest
import torch

from polytrain.data import GlobalBatchSampler, val_batches
from polytrain.data.sampler import epoch_seed
from polytrain.errors import ConfigError


def stream(sampler: GlobalBatchSampler, steps: int) -> list[int]:
    return [i for _ in range(steps) for i in sampler.next_batch()]


def dp_stream(n: int, g: int, seed: int, dp: int, steps: int, state=None) -> list[int]:
    """The global stream as the union of dp ranks' batches, step by step."""
    ranks = [GlobalBatchSampler(n, g, seed, r, dp) for r in range(dp)]
    if state is not None:
        for s in ranks:
            s.load_state_dict(state)
    out = []
    for _ in range(steps):
        for s in ranks:
            out += s.next_batch()
    return out


def test_first_epoch_is_the_documented_permutation():
    s = GlobalBatchSampler(10, 5, seed=7)
    gen = torch.Generator().manual_seed(epoch_seed(7, 0))
    assert stream(s, 2) == torch.randperm(10, generator=gen).tolist()


@pytest.mark.parametrize("n,g", [(10, 5), (7, 4), (13, 13), (5, 8)])
def test_every_epoch_is_a_permutation(n, g):
    s = GlobalBatchSampler(n, g, seed=1)
    steps = 3 * n  # covers >= 3 full epochs whatever g is
    out = stream(s, steps)
    epochs = [out[e * n : (e + 1) * n] for e in range(len(out) // n)]
    assert len(epochs) >= 3
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))  # no sample twice, none skipped
    assert s.consumed == steps * g and s.epoch == steps * g // n


def test_epochs_and_seeds_differ():
    a = stream(GlobalBatchSampler(50, 50, seed=1), 2)
    assert a[:50] != a[50:]
    assert stream(GlobalBatchSampler(50, 50, seed=1), 2) == a
    assert stream(GlobalBatchSampler(50, 50, seed=2), 2) != a


def test_epoch_property():
    s = GlobalBatchSampler(10, 4, seed=0)
    assert s.epoch == 0
    stream(s, 2)
    assert s.epoch == 0  # 8 consumed
    stream(s, 1)
    assert s.epoch == 1  # 12 consumed


@pytest.mark.parametrize("dp", [2, 4])
def test_union_of_ranks_equals_dp1(dp):
    n, g = 11, 8  # batches straddle epoch boundaries
    assert dp_stream(n, g, 3, dp, steps=9) == stream(GlobalBatchSampler(n, g, 3), 9)


def test_rank_slices_are_contiguous():
    full = GlobalBatchSampler(20, 8, 5).next_batch()
    assert GlobalBatchSampler(20, 8, 5, dp_rank=1, dp_size=2).next_batch() == full[4:]
    assert GlobalBatchSampler(20, 8, 5, dp_rank=3, dp_size=4).next_batch() == full[6:]


def test_resume_yields_identical_continuation():
    n, g = 17, 6
    ref = GlobalBatchSampler(n, g, 42)
    stream(ref, 5)
    state = ref.state_dict()
    assert state == {"consumed": 30, "seed": 42, "num_samples": 17, "global_batch_size": 6}
    resumed = GlobalBatchSampler(n, g, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert stream(resumed, 10) == stream(ref, 10)


def test_resume_across_dp_sizes():
    n, g = 13, 4
    # dp=2 for 7 steps, save, resume at dp=1: same continuation as an uninterrupted dp=1 run.
    ranks = [GlobalBatchSampler(n, g, 9, r, 2) for r in range(2)]
    for _ in range(7):
        for s in ranks:
            s.next_batch()
    assert ranks[0].state_dict() == ranks[1].state_dict()
    one = GlobalBatchSampler(n, g, 9)
    one.load_state_dict(ranks[0].state_dict())
    ref = GlobalBatchSampler(n, g, 9)
    stream(ref, 7)
    assert stream(one, 6) == stream(ref, 6)
    # ...and back from dp=1 to dp=2.
    assert dp_stream(n, g, 9, 2, steps=5, state=one.state_dict()) == stream(ref, 5)


def test_state_mismatch_errors():
    s = GlobalBatchSampler(10, 4, 0)
    with pytest.raises(ConfigError, match="covers 12 samples but the data now has 10"):
        s.load_state_dict({"consumed": 8, "seed": 0, "num_samples": 12, "global_batch_size": 4})
    with pytest.raises(ConfigError, match="train.global_batch_size = 8, not 4"):
        s.load_state_dict({"consumed": 8, "seed": 0, "num_samples": 10, "global_batch_size": 8})


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of dp_size = 4"):
        GlobalBatchSampler(10, 6, 0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank = 2"):
        GlobalBatchSampler(10, 4, 0, 2, 2)
    with pytest.raises(ValueError, match="num_samples"):
        GlobalBatchSampler(0, 4, 0)


def test_val_batches_layout():
    data = range(100)
    assert val_batches(data, 2, 3) == [[0, 1], [2, 3], [4, 5]]
    assert val_batches(data, 2, 2, dp_rank=0, dp_size=2) == [[0, 1], [4, 5]]
    assert val_batches(data, 2, 2, dp_rank=1, dp_size=2) == [[2, 3], [6, 7]]


def test_val_batches_union_and_wrap():
    data = range(5)  # smaller than 3 batches x 2 x 2 ranks
    ranks = [val_batches(data, 2, 3, r, 2) for r in range(2)]
    assert all(len(b) == 3 and all(len(m) == 2 for m in b) for b in ranks)
    union = [i for step in zip(*ranks) for mb in step for i in mb]
    assert union == [i % 5 for i in range(12)]
    assert val_batches(range(1), 3, 2) == [[0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="no samples"):
        val_batches(range(0), 2, 2)
