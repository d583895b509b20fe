"""The compiled decode step against the eager model, across a capacity growth, and its cache write-back."""

import mlx.core as mx
import numpy as np
import pytest

import lily_mlx
from bench.step_dispatch import NARROW, layer_stack
from lily_mlx import ops
from lily_mlx.decode import STEP, CompiledDecoder


SWITCHES = pytest.mark.parametrize("scatter, scalars", [(False, False), (True, False), (False, True)],
                                   ids=["slice-update", "kv_scatter", "device_scalars"])


@SWITCHES
def test_compiled_steps_equal_eager_steps_across_capacity_growth(tiny_checkpoints, scatter, scalars):
    with ops.switched("kv_scatter", scatter), ops.switched("device_scalars", scalars):
        _compiled_equals_eager(tiny_checkpoints)


def _compiled_equals_eager(tiny_checkpoints):
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
    assert worst <= 3e-5  # H200: 1.2e-5, attn_decode's float32 sums in another order than MLX's attention
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


def test_opting_into_a_switch_keys_a_new_step(tiny_checkpoints):
    """A switch opted into by name lets a chain take any rows (ops.chain_takes) though it was on already: the
    compiled step made before must not serve it."""
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert ops.enabled("qmv")  # on by default, not opted into
    plain = CompiledDecoder(model, cache)._fn
    with ops.switched("qmv", True):
        assert ops.enabled("qmv") and CompiledDecoder(model, cache)._fn is not plain


def test_not_applicable_to_other_caches(tiny_checkpoints):
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    cache = lily_mlx.make_cache(model, max_kv_size=16)
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert not CompiledDecoder.applicable(model, cache)  # rotating window: eager path
    with ops.disabled("compiled_decode"):
        plain = model.make_cache()
        model(mx.array([[1, 2, 3]]), cache=plain)
        assert not CompiledDecoder.applicable(model, plain)


def test_decoders_share_one_trace_until_weights_or_switches_change(tiny_checkpoints, monkeypatch):
    """A second decoder of the same model and capacity reuses the compiled trace (no re-trace per request);
    new weight arrays or a changed switch trace anew, and the step then reads the new weights."""
    import lily_mlx.decode as decode

    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    traced, real_step = [], decode._decode_step
    monkeypatch.setattr(decode, "_decode_step", lambda *a: traced.append(1) or real_step(*a))

    def step():
        cache = model.make_cache()
        model(mx.array([[5, 9, 33, 7]]), cache=cache)
        fast = CompiledDecoder(model, cache, reserve=8)(mx.array([[11]]))
        mx.eval(fast)
        return fast, model(mx.array([[11]]), cache=cache)[:, -1, :]  # the eager step on the same cache

    a, _ = step()
    b, _ = step()
    assert len(traced) == 1 and mx.array_equal(a, b).item()
    norm = model.language_model.model.norm
    norm.weight = norm.weight * 3  # a new array: the old trace holds the old one
    c, eager = step()
    assert len(traced) == 2 and not mx.allclose(a, c).item()
    assert float(mx.abs(c - eager).max() / mx.abs(eager).max()) <= 1e-5
    with ops.disabled("qmv"):  # any switch keys the trace
        step()
    assert len(traced) == 3


def test_token_dtypes_share_one_trace(tiny_checkpoints, monkeypatch):
    """A prompt's int32 token then sampled uint32 tokens run one trace: a trace per input dtype would trace the
    step again mid-decode, under whatever switches are set by then (bench A/Bs timed the wrong arm that way)."""
    import lily_mlx.decode as decode

    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    traced = []
    for name in ("_decode_step", "_stacked_step"):
        real = getattr(decode, name)
        monkeypatch.setattr(decode, name, lambda *a, _real=real, **k: traced.append(1) or _real(*a, **k))
    cache = model.make_cache()
    model(mx.array([[5, 9, 33, 7]]), cache=cache)
    dec = CompiledDecoder(model, cache, reserve=8)
    tok = mx.array([[11]], dtype=mx.int32)
    for _ in range(3):
        tok = mx.argmax(dec(tok), axis=-1)[:, None]  # uint32, as the samplers give
        mx.eval(tok)
    assert tok.dtype == mx.uint32 and len(traced) == 1


def test_fuse_projections_runs_again_only_after_new_arrays(tiny_checkpoints, monkeypatch):
    """Every compiled decoder calls fuse_projections: with the same parameter arrays it does nothing; after a fused
    part's weight is replaced it concatenates again, and the fused matmul reads the new weight."""
    from lily_mlx.layers import FusedLinears

    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])  # fused at load
    calls, real = [], FusedLinears.fuse
    monkeypatch.setattr(FusedLinears, "fuse", lambda self, pack=False: calls.append(1) or real(self, pack))
    model.fuse_projections()
    assert calls == []
    fused = next(model.fused_groups())
    part = fused.parts()[0]
    part.weight = part.weight * 2  # a new array: the fused concatenation no longer holds it
    assert not fused.current()
    model.fuse_projections()
    assert len(calls) == len(list(model.fused_groups())) and fused.current()
    n = part.weight.shape[0]
    assert mx.array_equal(fused.arrays["weight"][:n], part.weight).item()
    calls.clear()
    model.fuse_projections()
    assert calls == []


def test_shared_traces_do_not_keep_a_dropped_model_alive(tiny_checkpoints):
    import gc
    import weakref

    import lily_mlx.decode as decode

    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    cache = model.make_cache()
    model(mx.array([[5, 9, 33]]), cache=cache)
    dec = CompiledDecoder(model, cache, reserve=8)
    mx.eval(dec(mx.array([[1]])))
    alive, key = weakref.ref(model), id(model)
    assert key in decode._SHARED
    del model, dec, cache
    gc.collect()
    assert alive() is None and key not in decode._SHARED


def test_prefill_with_query_blocked_attention_equals_one_block(tiny_checkpoints, monkeypatch):
    """A model prefill whose attention runs in blocks of queries (the long-prompt memory bound), over a cached
    prefix, gives the logits of the unblocked prefill."""
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    prompt = mx.array([np.random.default_rng(1).integers(0, 512, size=45).tolist()])

    def prefill():
        cache = model.make_cache()
        model(prompt[:, :20], cache=cache)
        return model(prompt[:, 20:], cache=cache)  # 25 queries over 45 keys

    want = prefill()
    monkeypatch.setattr(ops, "MAX_ATTENTION_SCORES", 4 * 45 * 4)  # blocks of 4 queries (tiny model: 4 heads)
    got = prefill()
    assert float(mx.abs(got - want).max() / mx.abs(want).max()) <= 1e-5


def test_slot_batch_rows_decode_as_they_would_alone(tiny_checkpoints, monkeypatch):
    """SlotBatchDecoder: sequences of different lengths (one not prefilled) join free slots, a longer one moving every
    row right, the slots grow, rows leave, the batch compacts and crosses a capacity, and a row goes on alone in a
    CompiledDecoder: each row's logits at every step are the eager model's for that sequence alone, and joins and
    leaves trace nothing (one trace per slots and capacity)."""
    import lily_mlx.decode as decode
    from lily_mlx.decode import SlotBatchDecoder

    monkeypatch.setattr(decode, "STEP", 8)  # capacities of 8 columns: the rows cross several
    traced, real_step = [], decode._batch_step
    monkeypatch.setattr(decode, "_batch_step", lambda *a: traced.append(1) or real_step(*a))
    model, _ = lily_mlx.load_model(tiny_checkpoints[0]["mlx"])
    rng = np.random.default_rng(3)
    prompts = {"a": 5, "b": 12, "c": 3, "d": 1}  # d: a one-token prompt, nothing prefilled
    eager, joining = {}, {}
    for name, n in prompts.items():
        prompt = mx.array([rng.integers(0, 512, size=n - 1).tolist()])
        eager[name], joining[name] = model.make_cache(), model.make_cache()
        if n > 1:
            model(prompt, cache=eager[name])
            model(prompt, cache=joining[name])
    slots = SlotBatchDecoder(model, joining["a"], 2)
    at = {"a": slots.join(joining["a"])}
    shapes, worst = set(), 0.0

    def steps(n):
        nonlocal worst
        for _ in range(n):
            toks = {name: int(t) for name, t in zip(at, rng.integers(0, 512, size=len(at)))}
            x = [[0] for _ in range(slots.slots)]
            for name, s in at.items():
                x[s] = [toks[name]]
            shapes.add((slots.slots, slots.kv[0][0].shape[2]))
            got = slots(mx.array(x))
            for name, s in at.items():
                want = model(mx.array([[toks[name]]]), cache=eager[name])[0, -1]
                worst = max(worst, float(mx.abs(got[s] - want).max() / mx.abs(want).max()))

    steps(2)
    at["b"] = slots.join(joining["b"])  # 11 cached tokens against idx 6: every row moves right
    assert at == {"a": 0, "b": 1} and slots.idx == 11 and slots.start[0] == 5
    steps(2)
    slots.grow(4)
    at["c"], at["d"] = slots.join(joining["c"]), slots.join(joining["d"])
    assert (at["c"], at["d"], slots.start[3]) == (2, 3, slots.idx)
    steps(3)
    for name in ("a", "c"):
        slots.leave(at.pop(name))
    steps(1)
    moved = slots.compact(2)
    at = {name: moved[s] for name, s in at.items()}
    assert sorted(at.values()) == [0, 1] and slots.slots == 2
    steps(12)  # past the capacity of 24 columns
    assert worst <= 3e-5
    assert len(traced) == len(shapes) and len(shapes) >= 4
    alone = slots.sequence_cache(at["b"])
    dec = CompiledDecoder(model, alone, reserve=8)
    x = mx.array([[42]])
    want = model(x, cache=eager["b"])[:, -1, :]
    assert alone[3].offset == eager["b"][3].offset - 1
    assert float(mx.abs(dec(x) - want).max() / mx.abs(want).max()) <= 3e-5
    with pytest.raises(ValueError, match="slots are taken"):
        slots.join(joining["a"])


@SWITCHES
def test_stacked_kv_steps_equal_eager_steps_and_write_back(scatter, scalars):
    """stacked_kv: the attention layers' caches as planes of one [P*B, Hkv, capacity, D] buffer, the step writing
    every layer's new row at once, equals the eager model across a capacity growth (batch 2), and its write-back
    hands each layer its own plane."""
    with ops.switched("kv_scatter", scatter), ops.switched("device_scalars", scalars):
        _stacked_equals_eager()


def _stacked_equals_eager():
    from bench import random_model
    from lily_mlx.config import ModelConfig
    from lily_mlx.model import Model

    # The 35B-A3B layer pattern at NARROW widths, unquantized float32: 12 layers, three attention layers, three planes.
    model = Model(ModelConfig.from_dict(random_model.config_json("35b-a3b", dict(NARROW, num_hidden_layers=12), 0, 4,
                                                                 64, "float32")))
    mx.eval(model.parameters())
    prompt = mx.array(np.random.default_rng(1).integers(0, NARROW["vocab_size"], size=(2, 9)))
    eager, fast = model.make_cache(), model.make_cache()
    model(prompt, cache=eager)
    model(prompt, cache=fast)
    with ops.switched("stacked_kv", True):
        dec = CompiledDecoder(model, fast, reserve=8)
    n_attn = sum(not l.is_linear for l in model.layers)
    assert dec.stacked and n_attn == 3 and len(dec.kv) == 1 and dec.kv[0][0].shape[0] == 2 * n_attn
    tokens = np.random.default_rng(0).integers(0, NARROW["vocab_size"], size=(STEP + 12, 2))  # crosses a capacity
    worst = 0.0
    for t in tokens:
        x = mx.array(t[:, None])
        a = model(x, cache=eager)[:, -1, :]
        b = dec(x)
        worst = max(worst, float(mx.abs(a - b).max() / mx.abs(a).max()))
    assert worst <= 3e-5  # H200: 1.2e-5, attn_decode's float32 sums in another order than MLX's attention
    dec.write_back()
    for i, c in enumerate(fast):
        if not model.layers[i].is_linear:
            n = c.offset
            assert n == eager[i].offset and mx.array_equal(c.keys[..., :n, :], eager[i].keys[..., :n, :]).item()
    x = mx.array([[42], [7]])
    assert float(mx.abs(model(x, cache=eager) - model(x, cache=fast)).max()) <= 1e-4


@pytest.mark.cuda
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_kv", "per-layer"])
def test_kv_write_steps_equal_steps_without_it_cuda(monkeypatch, stacked):
    """kv_write moves where the new K/V rows are written and nothing else: two compiled decoders from one prefilled
    cache of a bf16 model (three attention layers) at one row (attn_chain's), kv_write on and off, give the same
    logits every step across a capacity growth and hold the same K/V rows, bit for bit; every attention launch of
    the traced step marks its rows written; the write-back hands the caller's cache those rows. (Against the eager
    model the chained steps agree to ~1e-5 only, kv_write or not: H100 run 72.)"""
    from lily_mlx.ops import attn_decode

    marked = []  # the shapes of the k_new arrays attn_chain marks as written into the cache in place
    real = attn_decode.mark_written
    monkeypatch.setattr(attn_decode, "mark_written", lambda k: marked.append(k.shape) or real(k))
    model = layer_stack(12)  # quantized and fused, so the attention layers take attn_chain
    rng = np.random.default_rng(1)
    cache = model.make_cache()
    # One token a call: a 9-token bf16 prefill takes MLX's qmm_sm90, whose NVRTC build needs crt/mma.h, which the
    # device's CUDA headers lack (run 74); one row takes the qmv path every decode step takes.
    for t in rng.integers(0, NARROW["vocab_size"], size=9):
        model(mx.array([[int(t)]]), cache=cache)
    decoders = {}
    for on in (False, True):  # each copies the prefilled rows into buffers of its own
        with ops.switched("kv_write", on), ops.switched("stacked_kv", stacked):
            decoders[on] = CompiledDecoder(model, cache, reserve=8)
    assert decoders[True].stacked == stacked and len(decoders[True].kv) == (1 if stacked else 3)
    for t in rng.integers(0, NARROW["vocab_size"], size=STEP + 12):  # crosses a capacity
        logits = {}
        for on, dec in decoders.items():
            with ops.switched("kv_write", on), ops.switched("stacked_kv", stacked):
                logits[on] = dec(mx.array([[int(t)]]))
        assert mx.array_equal(logits[False], logits[True]).item()
    n = 9 + STEP + 12
    for (k_off, v_off), (k_on, v_on) in zip(decoders[False].kv, decoders[True].kv):
        assert mx.array_equal(k_off[..., :n, :], k_on[..., :n, :]).item()
        assert mx.array_equal(v_off[..., :n, :], v_on[..., :n, :]).item()
    assert len(marked) >= 3, f"in-place writes marked: {marked}"  # the traced step's three attention launches
    decoders[True].write_back()
    keys_off = decoders[False].kv[0][0]
    for p, i in enumerate(i for i, layer in enumerate(model.layers) if not layer.is_linear):
        want = keys_off[p:p + 1] if stacked else decoders[False].kv[p][0]
        assert cache[i].offset == n and mx.array_equal(cache[i].keys[..., :n, :], want[..., :n, :]).item()


@pytest.mark.cuda
@pytest.mark.parametrize("chains", [False, True], ids=["unchained", "every-chain"])
def test_device_scalars_decode_the_same_cuda(chains):
    """The compiled decoder's steps with the offset and the attention planes in device memory (device_scalars) give
    the logits they give without, bit for bit (the same values read from elsewhere): the embedded 4-bit model, float32,
    every chain on or off."""
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    model, _ = lily_mlx.load_model(EMBEDDED_4BIT_MODEL, dtype=mx.float32)
    prompt = mx.array(np.random.default_rng(0).integers(0, 2048, (1, 40)))
    logits = {}
    with ops.disabled():  # restores every switch afterwards
        for name in ("moe_chain", "deltanet_chain_out", "attn_chain"):
            ops.set_enabled(name, chains)
        for on in (False, True):
            ops.set_enabled("device_scalars", on)
            cache = model.make_cache()
            model(prompt, cache=cache)
            dec, tok, out = CompiledDecoder(model, cache, reserve=8), prompt[:, -1:], []
            for _ in range(6):
                out.append(dec(tok))
                tok = mx.argmax(out[-1], axis=-1)[:, None]
            logits[on] = mx.stack(out)
    assert mx.array_equal(logits[True], logits[False]).item()
