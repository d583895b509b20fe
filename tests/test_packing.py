"""Packed quantized weights and bundled chain inputs (ops/packing.py): the layouts, the views the model keeps, the
kernels' packed and bundled variants.

Each family's emulated kernel test also runs its cases with packed weights, and each decode chain's with its inputs
bundled (Emulator(packed_twins=True)), and checks them bit for bit against the plain launch; here: the layouts
themselves, a row count whose scales end mid-word, the model's packing and bundling and the dispatcher's swaps.
"""

from __future__ import annotations

import contextlib
import gc

import mlx.core as mx
import numpy as np
import pytest

from bench.step_dispatch import CHAINS, layer_stack
from emulator import GXX, Emulator
from lily_mlx import ops
from lily_mlx.ops import kernels, packing, qmv, reference


def _weight(shape, gs=32, bits=4, dtype=mx.bfloat16, seed=0):
    w, s, b = mx.quantize(mx.random.normal(shape, key=mx.random.key(seed)) * 0.05, group_size=gs, bits=bits)
    return w, s.astype(dtype), b.astype(dtype)


def _holds_no_copy(grown: int, made: int) -> bool:
    """Whether memory grew by the array made and no more, up to a few small buffers another test's arrays (freed or
    made meanwhile) may account for: a copy of the views would add about `made` again."""
    return made <= grown + 8192 and grown < made + 16384


@pytest.mark.parametrize("shape, dtype", [((11, 96), mx.bfloat16), ((11, 96), mx.float32), ((3, 5, 64), mx.float16),
                                          ((256, 512), mx.bfloat16)])
def test_views_equal_the_weight_and_share_one_buffer(shape, dtype):
    w, s, b = _weight(shape, dtype=dtype)
    mx.eval(w, s, b)
    gc.collect()
    before = mx.get_active_memory()
    packed, w2, s2, b2 = packing.pack(w, s, b)
    if packed.nbytes > 16384:  # past the allocator's rounding of small buffers
        assert _holds_no_copy(mx.get_active_memory() - before, packed.nbytes)
    for old, new in ((w, w2), (s, s2), (b, b2)):
        assert new.dtype == old.dtype and new.shape == old.shape and mx.array_equal(new, old).item()
    assert packed.dtype == mx.uint32 and packed.shape[:-1] == w.shape[:-1]  # the rows, as kernels read them
    rows = int(np.prod(w.shape[:-1]))
    s_at, b_at, end = packing.offsets(rows, w.shape[-1], s.shape[-1], dtype.size)
    assert s_at % 4 == 0 and b_at % 4 == 0 and end <= packed.size  # every block 16-byte aligned, inside the array
    words = np.array(packed).reshape(-1)
    assert np.array_equal(words[:rows * w.shape[-1]], np.array(w).reshape(-1))
    got_s = words[s_at:b_at].view(np.uint8)[:s.nbytes]
    assert np.array_equal(got_s, np.array(s.view(mx.uint8)).reshape(-1))


def test_lookup_finds_only_the_views_it_made():
    w, s, b = _weight((11, 96))
    packed, w2, s2, b2 = packing.pack(w, s, b)
    assert packing.lookup(w2, s2, b2) is packed
    assert packing.lookup(w, s, b) is None  # the originals: not views of it
    assert packing.lookup(w2, b2, s2) is None  # scales and biases swapped
    assert packing.lookup(w2, s2 * 1, b2) is None  # a copy of the scales
    del w2
    gc.collect()
    assert packing.lookup(*packing.pack(w, s, b)[1:]) is not None and len(packing._PACKED) == 1  # the first entry left


def test_unpackable_weights_say_why():
    w, s, b = _weight((11, 96))
    assert "uint32" in packing.why_not(s, s, b)
    assert "differ" in packing.why_not(w, s, b.astype(mx.float32))
    assert "leading dims" in packing.why_not(w, s[:5], b[:5])
    with pytest.raises(ValueError, match="cannot pack"):
        packing.pack(w, s, b[:5])


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_scales_ending_mid_word_pack_through_qmv(tmp_path):
    """11 rows of 3 bf16 scales end mid-word (66 bytes): the biases block starts at the next aligned word, as the
    kernel's preamble finds it; qmv_pw gives qmv's output bit for bit, and both the reference's."""
    M, K, N, gs = 3, 96, 11, 32
    w, s, b = _weight((N, K), gs)
    x = mx.random.normal((M, K), key=mx.random.key(1)).astype(mx.bfloat16)
    inst = qmv.instance(mx.bfloat16, s.dtype, 4, K, N, 4, gs, None, False, 1e-6)
    p = qmv.plan(4, K, N, 4)
    threads = 32 * p["WARPS"]
    emu = Emulator(tmp_path, packed_twins=True)
    emu.add(qmv.SPEC, inst, [x, w, s, b, kernels.placeholder(mx.bfloat16), kernels.placeholder(mx.bfloat16)],
            (p["blocks"] * threads, 1, 1), (threads, 1, 1), [(M, N)])
    (y,), = emu.run()
    assert emu.twins, "the weight did not pack"
    with mx.stream(mx.cpu):
        ref = reference.quantized_matmul_oracle(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32),
                                                group_size=gs, bits=4)
    err = (mx.linalg.norm(y.astype(mx.float32) - ref) / mx.linalg.norm(ref)).item()
    assert err < 8e-3


def test_model_packs_every_quantized_weight_and_computes_the_same():
    """pack_weights leaves every weight a view of a packed array (fused parts views of their packed concatenation),
    the logits bit for bit the same, and MLX's cache keeps none of the old buffers (other processes on the GPU need
    them); again it packs nothing."""
    model = layer_stack()
    x = mx.array([[1, 2, 3, 4, 5]])
    before = model(x)
    mx.eval(before)
    weights = mx.get_active_memory()
    model.fuse_projections(pack=True)
    assert mx.get_cache_memory() < 0.05 * weights
    assert model.pack_weights() == 0
    groups = list(model.fused_groups())
    assert len(groups) == 2 * len(model.layers) and all(f.current() and f.packed() is not None for f in groups)
    fused = {id(p) for f in groups for p in f.parts()}
    unfused = [m for _, m in model.named_modules() if "scales" in m and id(m) not in fused]
    # a layer's out_proj or o_proj, the experts' and the shared expert's gate, up, down; the embedding, the lm_head
    assert len(unfused) == 7 * len(model.layers) + 2
    assert all(packing.lookup(m["weight"], m["scales"], m["biases"]) is not None for m in unfused)
    assert mx.array_equal(model(x), before).item()


def test_dispatcher_swaps_in_the_packed_variant(monkeypatch):
    """With packed_weights on, a launch whose weight arrays are a packed array's views runs the _pw variant with the
    packed array and the layout's template arguments; off, or with any other array, the plain kernel."""
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda name, backend, inputs, template, *rest: launched.append(
        (name, inputs, dict(template))) or [mx.zeros((1, 11))])
    K, N, gs = 96, 11, 32
    packed, w, s, b = packing.pack(*_weight((N, K), gs))
    x = mx.zeros((1, K), dtype=mx.bfloat16)
    with ops.switched("packed_weights", True):
        qmv.qmv(x, w, s, b, group_size=gs, bits=4, backend="metal")
        qmv.qmv(x, w, s * 1, b, group_size=gs, bits=4, backend="metal")
    qmv.qmv(x, w, s, b, group_size=gs, bits=4, backend="metal")
    (name, inputs, template), plain_copy, plain_off = launched
    assert name == "qmv_pw" and inputs[1] is packed and len(inputs) == len(qmv.SPEC.input_names) - 2
    assert template["w_pw_st"] == mx.bfloat16 and template["w_pw_wrow"] == K // 8 and template["w_pw_srow"] == K // gs
    assert plain_copy[0] == "qmv" and plain_off[0] == "qmv"


def _decode_on_vs_off(backend_marker: str, switch: str, base: tuple = ()) -> None:
    """The embedded 4-bit model in float32 with `base` switched on: a prompt, then 6 compiled decode steps with
    `switch` (packed_weights or bundled_weights) off, then on. On, every launch of a kernel with a variant for it is
    that variant (packed: every kernel that reads quantized weights, from the prompt on; bundled: every decode chain),
    off none is, and the logits agree."""
    import switch_ab
    from lily_mlx.decode import CompiledDecoder

    packed = switch == "packed_weights"
    swaps = (lambda s: bool(s.weights)) if packed else (lambda s: bool(s.bundle))
    variant = (lambda s: bool(s.packed_from)) if packed else (lambda s: bool(s.bundled_from))
    model, toks = switch_ab._model(mx.float32), switch_ab._tokens(40)
    real, logits = kernels.launch, {}
    for on in (False, True):
        launched = []
        with contextlib.ExitStack() as stack:
            for name in base:
                stack.enter_context(ops.switched(name, True))
            stack.enter_context(ops.switched(switch, on))
            mp = stack.enter_context(pytest.MonkeyPatch.context())
            mp.setattr(kernels, "launch", lambda name, *a: launched.append(name) or real(name, *a))
            model.fuse_projections(pack=on and packed)  # before the prompt, whose launches are counted too
            cache = model.make_cache()
            steps = [model(toks, cache=cache)[:, -1]]
            dec = CompiledDecoder(model, cache)  # bundles the chains' inputs when bundled_weights is on
            if not packed:
                launched.clear()
            for _ in range(6):
                steps.append(dec(mx.argmax(steps[-1], axis=-1)[:, None].astype(mx.int32)))
            logits[on] = mx.stack(steps)
            mx.eval(logits[on])
        plain = sorted({n for n in launched if swaps(kernels.SPECS[n]) and not variant(kernels.SPECS[n])})
        assert launched and (not plain if on else not any(variant(kernels.SPECS[n]) for n in launched)), \
            f"{backend_marker}: {switch} {'on' if on else 'off'}: {plain or launched}"
    err = (mx.linalg.norm(logits[True] - logits[False]) / mx.linalg.norm(logits[False])).item()
    assert err < 1e-6, f"{backend_marker}: decode logits with {switch}: rel err {err:.2e}"


@pytest.mark.cuda
def test_decode_with_packed_weights_cuda():
    _decode_on_vs_off("cuda", "packed_weights")


@pytest.mark.metal
def test_decode_with_packed_weights_metal():
    _decode_on_vs_off("metal", "packed_weights")


@pytest.mark.cuda
def test_decode_with_bundled_weights_cuda():
    _decode_on_vs_off("cuda", "bundled_weights", CHAINS)


@pytest.mark.metal
def test_decode_with_bundled_weights_metal():
    _decode_on_vs_off("metal", "bundled_weights", CHAINS)


def _members(seed=0):
    """A chain's mix of constants: norm weights of odd length, float32 params, weights of two ranks and scale types."""
    return [mx.random.normal((7,), key=mx.random.key(seed)).astype(mx.bfloat16), _weight((11, 96), seed=seed + 1),
            mx.random.normal((3,), key=mx.random.key(seed + 2)), _weight((3, 5, 64), dtype=mx.float16, seed=seed + 3),
            _weight((256, 512), seed=seed + 4)]


def test_bundle_views_equal_the_members_and_share_one_buffer():
    members = _members()
    mx.eval(members)
    gc.collect()
    before = mx.get_active_memory()
    blob, views = packing.bundle(members)
    assert _holds_no_copy(mx.get_active_memory() - before, blob.nbytes)
    starts, total = packing.layout(members)
    assert blob.dtype == mx.uint32 and blob.shape == (total,) and all(s % 4 == 0 for s in starts)  # 16-byte aligned
    for m, v, start in zip(members, views, starts):
        if packing.is_weight(m):
            head = packing.lookup(*v)  # the weight's packed array: pack()'s layout, at its offset in the bundle
            assert head is not None and np.array_equal(np.array(head), np.array(packing.pack(*m)[0]))
        else:
            head = v
        assert packing.bundled(head)[0] is blob and packing.bundled(head)[1] == start
        for old, new in zip(m, v) if packing.is_weight(m) else ((m, v),):
            assert new.dtype == old.dtype and new.shape == old.shape and mx.array_equal(new, old).item()
    assert packing.bundled(members[0]) is None and packing.bundled(views[0] * 1) is None


def test_unbundleable_members_say_why():
    with pytest.raises(ValueError, match=r"cannot bundle a int64 array \(3,\)"):
        packing.bundle([mx.zeros((3,), dtype=mx.int64)])
    w, s, b = _weight((11, 96))
    with pytest.raises(ValueError, match="cannot bundle this quantized weight: scales"):
        packing.bundle([(w, s, b.astype(mx.float32))])


def test_dispatcher_swaps_in_the_bundled_variant(monkeypatch):
    """With bundled_weights on, a chain launch whose every constant is one bundle's view runs the _pb variant: the
    bundle in place of those inputs, each member's offset (and a weight's layout) in the template; with one member
    not in the bundle, or the switch off, the plain or packed kernel."""
    from lily_mlx.ops import deltanet_chain

    spec = deltanet_chain.SPEC
    inst = spec.instances()[-1]
    arrays = [mx.zeros(shape, dtype=dtype) for dtype, shape in inst.inputs]
    named = dict(zip(spec.input_names, arrays))
    named["w"], named["scales"], named["biases"] = _weight((inst.inputs[1][1][0], 8 * inst.inputs[1][1][1]),
                                                           gs=8 * inst.inputs[1][1][1] // inst.inputs[2][1][1])
    members = kernels.bundle_members(spec, named)
    blob, views = packing.bundle(members)
    for m, v in zip(spec.bundle, views):
        named.update(zip(("w", "scales", "biases"), v) if m == "w" else [(m, v)])
    launched = []
    monkeypatch.setattr(kernels, "launch", lambda name, backend, inputs, template, *rest: launched.append(
        (name, inputs, dict(template))) or [mx.zeros((1,))])
    args = [named[n] for n in spec.input_names]
    with ops.switched("bundled_weights", True), ops.switched("packed_weights", True):
        kernels.call(spec.name, "metal", args, inst.template, (32, 1, 1), (32, 1, 1), [(1,)], [mx.float32])
        copy = [a * 1 if n == "A_log" else a for n, a in zip(spec.input_names, args)]
        kernels.call(spec.name, "metal", copy, inst.template, (32, 1, 1), (32, 1, 1), [(1,)], [mx.float32])
    kernels.call(spec.name, "metal", args, inst.template, (32, 1, 1), (32, 1, 1), [(1,)], [mx.float32])
    (name, inputs, template), one_copied, off = launched
    assert name == "deltanet_chain_pb" and inputs[kernels.SPECS[name].input_names.index("bundle")] is blob
    assert len(inputs) == len(spec.input_names) - 8 + 1  # for w, scales, biases, nw, conv_weight, A_log, dt_bias,
    # norm_weight: the bundle
    starts = packing.layout(members)[0]
    assert [template[f"{m}_at"] for m in spec.bundle] == starts and template["A_log_t"] == mx.float32
    assert one_copied[0] == "deltanet_chain_pw" and off[0] == "deltanet_chain"


def test_model_bundles_every_chain_launch_and_computes_the_same(monkeypatch):
    """A compiled decoder with bundled_weights bundles each chain launch's constants (40 MoE blocks, 30 DeltaNet and
    10 attention layers), every chain launch of its step is then a _pb variant, the model's arrays are views with
    nothing held twice, and its logits are bit for bit the same; a second decoder neither bundles again nor
    re-traces, and bundling again finds nothing to do."""
    from bench.step_dispatch import decoder, standin

    model = layer_stack()
    x = mx.array([[1, 2, 3, 4, 5]])
    before = model(x)
    mx.eval(before)
    gc.collect()
    memory = mx.get_active_memory()
    made, cached = [], []
    real = model.bundle_weights
    monkeypatch.setattr(model, "bundle_weights",
                        lambda run: made.append(real(run)) or cached.append(mx.get_cache_memory()) or made[-1])
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "launch", standin)
        mp.setattr(ops, "backend", lambda: "cuda")
        names = [name for _ in range(2) for name, *_ in decoder(model, CHAINS + ("bundled_weights",), 8)[1]]
    assert made == [80]  # the second decoder did not trace for bundling again: nothing could have changed
    assert cached[0] < 0.05 * memory  # MLX kept none of the old buffers for reuse (other processes need them)
    chain_launches = [n for n in names if n.removesuffix(kernels.BUNDLED) in CHAINS + ("attn_chain_long",)]
    # the second decoder re-traced nothing: bundling left the arrays its trace is keyed on as they were
    assert len(chain_launches) == 80 and all(n.endswith(kernels.BUNDLED) for n in chain_launches)
    assert all(f.current() for f in model.fused_groups())
    gc.collect()
    assert abs(mx.get_active_memory() - memory) < 0.05 * memory  # the old arrays are gone: views, not copies
    assert mx.array_equal(model(x), before).item()
    with monkeypatch.context() as mp, ops.switched("moe_chain", True), ops.switched("bundled_weights", True):
        mp.setattr(kernels, "launch", standin)
        mp.setattr(ops, "backend", lambda: "cuda")
        cache = model.make_cache()
        model(x, cache=cache)
        with kernels.captured() as seen:
            model(mx.array([[1]]), cache=cache)
        assert sum(spec.name == "moe_chain" for spec, _ in seen) == 40
        assert real(lambda: model(mx.array([[1]]), cache=cache)) == 0  # each MoE block's constants: a bundle already


def test_packing_leaves_float_weights_and_their_fusion_alone():
    """A float model has nothing to pack: asking for it keeps every array (a re-fusion would make new ones and so a
    new decode trace for every decoder)."""
    from mlx.utils import tree_flatten

    from bench import random_model
    from bench.step_dispatch import NARROW
    from lily_mlx.config import ModelConfig
    from lily_mlx.model import Model

    model = Model(ModelConfig.from_dict(random_model.config_json("35b-a3b", dict(NARROW, num_hidden_layers=4), 0, 4,
                                                                 64, "float32")))
    model.fuse_projections()
    before = [id(a) for _, a in tree_flatten(model.parameters())]
    model.fuse_projections(pack=True)
    assert [id(a) for _, a in tree_flatten(model.parameters())] == before and model.pack_weights() == 0
