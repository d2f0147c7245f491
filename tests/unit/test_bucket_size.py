"""The measured bucket size: B* = sqrt(N x latency x bandwidth), a power of two within its bounds."""

from __future__ import annotations

import math

from polytrain.distributed.bucket_size import MIN_BUCKET_ELEMENTS, BucketChoice, ReductionCost, bucket_elements

CAP = 25 * 2**20 // 4  # the default 25 MiB of fp32 gradient, in elements


def test_the_optimum_balances_latency_and_the_last_buckets_transfer():
    # 100 us + 1 GB/s, 4e8 bytes of gradient: B* = sqrt(4e8 * 1e-4 * 1e9) = 6.32e6 bytes = 1.58e6
    # elements, rounded down to 2^20 elements.
    cost = ReductionCost(latency_s=1e-4, bytes_per_s=1e9)
    assert bucket_elements(cost, n_elements=10**8, cap_elements=CAP) == (2**20, False)
    # At B* the two terms of wait(B) = (N / B) latency + B / bandwidth are equal, and
    # wait is larger a factor of two either side.
    n_bytes, best = 4e8, math.sqrt(4e8 * 1e-4 * 1e9)

    def wait(b):
        return n_bytes / b * 1e-4 + b / 1e9

    assert math.isclose(n_bytes / best * 1e-4, best / 1e9)
    assert wait(best) < min(wait(best / 2), wait(best * 2))


def test_bounds():
    slow = ReductionCost(latency_s=1e-2, bytes_per_s=1e9)  # B* = 63 MB, above 25 MiB
    assert bucket_elements(slow, 10**8, CAP) == (CAP, True)
    fast = ReductionCost(latency_s=1e-7, bytes_per_s=1e9)  # B* = 63 KB
    assert bucket_elements(fast, 10**8, CAP) == (MIN_BUCKET_ELEMENTS, False)
    assert bucket_elements(fast, 10**8, cap_elements=20_000) == (20_000, True)  # the bound wins over the floor
    none = ReductionCost(latency_s=0.0, bytes_per_s=1e9)
    assert bucket_elements(none, 10**8, CAP) == (MIN_BUCKET_ELEMENTS, False)
    free = ReductionCost(latency_s=1e-4, bytes_per_s=math.inf)  # bandwidth not measurable: latency only
    assert bucket_elements(free, 10**8, CAP) == (CAP, True)


def test_a_slightly_different_measurement_gives_the_same_size():
    sizes = {bucket_elements(ReductionCost(1e-4 * f, 1e9), 10**8, CAP)[0] for f in (0.9, 1.0, 1.1)}
    assert sizes == {2**20}


def test_describe_names_the_figures():
    text = BucketChoice(ReductionCost(1.25e-4, 5.96e9), elements=2**19, capped=False).describe()
    assert text == "ZeRO buckets of 2 MiB fp32 (reduce-scatter measured: 125 us + 5.96 GB/s)"
