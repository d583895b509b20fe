"""Packed quantized weights (ops/packing.py): the layout, the views the model keeps, the kernels' packed variants.

Each family's emulated kernel test also runs its cases with packed weights (Emulator(packed_twins=True)) and checks
them bit for bit against the unpacked launch; here: the layout itself, a row count whose scales end mid-word, the
model's packing and the dispatcher's swap.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from bench.step_dispatch import layer_stack
from emulator import GXX, Emulator
from lily_mlx import ops
from lily_mlx.ops import kernels, packing, qmv, reference


def _weight(shape, gs=32, bits=4, dtype=mx.bfloat16, seed=0):
    w, s, b = mx.quantize(mx.random.normal(shape, key=mx.random.key(seed)) * 0.05, group_size=gs, bits=bits)
    return w, s.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("shape, dtype", [((11, 96), mx.bfloat16), ((11, 96), mx.float32), ((3, 5, 64), mx.float16),
                                          ((256, 512), mx.bfloat16)])
def test_views_equal_the_weight_and_share_one_buffer(shape, dtype):
    w, s, b = _weight(shape, dtype=dtype)
    mx.eval(w, s, b)
    before = mx.get_active_memory()
    packed, w2, s2, b2 = packing.pack(w, s, b)
    if packed.nbytes > 16384:  # past the allocator's rounding of small buffers
        assert mx.get_active_memory() - before == packed.nbytes  # the views hold no copy
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
    the logits bit for bit the same; again it packs nothing."""
    model = layer_stack()
    x = mx.array([[1, 2, 3, 4, 5]])
    before = model(x)
    model.fuse_projections(pack=True)
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


def _decode_packed_on_vs_off(backend_marker: str) -> None:
    """The embedded 4-bit model in float32: a prompt, then 6 compiled decode steps with packed_weights off, then on.
    On, every launch of a kernel that reads quantized weights is its packed variant, and the logits agree."""
    import switch_ab
    from lily_mlx.decode import CompiledDecoder

    model, toks = switch_ab._model(mx.float32), switch_ab._tokens(40)
    real, logits = kernels.launch, {}
    for on in (False, True):
        launched = []
        with ops.switched("packed_weights", on):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kernels, "launch", lambda name, *a: launched.append(name) or real(name, *a))
                model.fuse_projections(pack=on)  # before the prompt, whose launches are counted too
                cache = model.make_cache()
                steps = [model(toks, cache=cache)[:, -1]]
                dec = CompiledDecoder(model, cache)
                for _ in range(6):
                    steps.append(dec(mx.argmax(steps[-1], axis=-1)[:, None].astype(mx.int32)))
                logits[on] = mx.stack(steps)
                mx.eval(logits[on])
        unpacked = sorted({n for n in launched if kernels.SPECS[n].weights and not kernels.SPECS[n].packed_from})
        assert launched and (not unpacked if on else not any(kernels.SPECS[n].packed_from for n in launched)), \
            f"{backend_marker}: packed_weights {'on' if on else 'off'}: {unpacked or launched}"
    err = (mx.linalg.norm(logits[True] - logits[False]) / mx.linalg.norm(logits[False])).item()
    assert err < 1e-6, f"{backend_marker}: decode logits with packed_weights: rel err {err:.2e}"


@pytest.mark.cuda
def test_decode_with_packed_weights_cuda():
    _decode_packed_on_vs_off("cuda")


@pytest.mark.metal
def test_decode_with_packed_weights_metal():
    _decode_packed_on_vs_off("metal")


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
