"""The GPU checks every kernel that orders its phases through counters (kernels.sync_counters) shares: launches
built before one eval, which MLX's CUDA graphs may run at once, and the counters each launch leaves behind."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from lily_mlx.ops import kernels


@contextmanager
def recorded_counters():
    """Yields the list of counters that kernels.sync_counters hands out inside the block, in order."""
    made, real = [], kernels.sync_counters
    kernels.sync_counters = lambda: made.append(real()) or made[-1]
    try:
        yield made
    finally:
        kernels.sync_counters = real


def assert_launches_agree(run, what: str):
    """run() once alone, then twice built before one mx.eval: each launch had counters of its own, the three results
    are equal to the bit, and every launch left its counters zero (a compiled trace replays them). -> the first."""
    first = run()
    mx.eval(first)
    with recorded_counters() as made:
        together = run(), run()
        mx.eval(together)
    assert len(made) == 2 and made[0] is not made[1], f"{what}: the two launches shared counters"
    for out in together:
        for f, s in zip(first, out):
            assert mx.array_equal(f, s, equal_nan=True).item(), f"{what}: a launch in one eval with another differs"
    assert not any(np.array(c).any() for c in made), f"{what}: a launch left its counters nonzero"
    return first
