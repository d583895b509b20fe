"""The compiled decode step against the eager model, across a capacity growth, and its cache write-back."""

import mlx.core as mx
import numpy as np

import lily_mlx
from lily_mlx import ops
from lily_mlx.decode import STEP, CompiledDecoder


def test_compiled_steps_equal_eager_steps_across_capacity_growth(tiny_checkpoints):
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    prompt = mx.array([[5, 9, 33, 7, 101, 2, 64, 12, 400, 17, 3]])
    eager, fast = model.make_cache(), model.make_cache()
    model(prompt, cache=eager)
    model(prompt, cache=fast)
    dec = CompiledDecoder(model, fast, reserve=8)
    assert CompiledDecoder.applicable(model, fast)
    tokens = np.random.default_rng(0).integers(0, 512, size=STEP + 20)  # crosses the first capacity
    worst = 0.0
    for t in tokens:
        x = mx.array([[int(t)]])
        a = model(x, cache=eager)[:, -1, :]
        b = dec(x)
        worst = max(worst, float(mx.abs(a - b).max() / mx.abs(a).max()))
    assert worst <= 1e-5
    dec.write_back()
    x = mx.array([[42]])
    assert float(mx.abs(model(x, cache=eager) - model(x, cache=fast)).max()) <= 1e-4
    assert fast[3].offset == eager[3].offset


def test_generate_step_updates_the_callers_cache_with_and_without_compile(tiny_checkpoints):
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    prompt = mx.array([5, 9, 33, 7, 101, 2])
    runs = []
    for on in (True, False):
        ops.set_enabled("compiled_decode", on)
        try:
            cache = lily_mlx.make_cache(model)
            toks = [t for t, _ in zip((t for t, _ in lily_mlx.generate_step(prompt, model, max_tokens=10, prompt_cache=cache)), range(10))]
            nxt = model(mx.array([[toks[-1]]]), cache=cache)
            runs.append((toks, np.array(nxt), cache[3].offset))
        finally:
            ops.set_enabled("compiled_decode", True)
    (ta, la, oa), (tb, lb, ob) = runs
    assert ta == tb and oa == ob
    assert np.abs(la - lb).max() / np.abs(lb).max() <= 1e-4


def test_not_applicable_to_other_caches(tiny_checkpoints):
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    cache = lily_mlx.make_cache(model, max_kv_size=16)
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert not CompiledDecoder.applicable(model, cache)  # rotating window: eager path
    with ops.disabled("compiled_decode"):
        plain = model.make_cache()
        model(mx.array([[1, 2, 3]]), cache=plain)
        assert not CompiledDecoder.applicable(model, plain)
