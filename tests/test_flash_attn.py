"""flash_attn (prefill attention, online softmax) against reference.attention.

CPU: the kernel's Metal source run by the shim's SIMT emulator on odd shapes, outputs poisoned with NaN; the
dispatcher's declines. GPU (`cuda`/`metal`): the kernel through MLX at odd shapes and the model's (head_dim 256,
GQA 16:2, a prefix in the cache), and whole-model prefill logits with it on vs off.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import lily_mlx
from lily_mlx import ops
from lily_mlx.embedded import EMBEDDED_MODEL
from lily_mlx.ops import flash_attn as fa
from lily_mlx.ops import reference
from emulator import GXX, Emulator
from test_deltanet_chunk import _rel

F32, BF16, F16 = mx.float32, mx.bfloat16, mx.float16


class Case:
    """B, Hq, Hkv, L queries over S keys (the last L positions), head dim D, causal, dtype."""

    def __init__(self, B, Hq, Hkv, L, S, D, causal=True, dtype=BF16):
        self.B, self.Hq, self.Hkv, self.L, self.S, self.D, self.causal, self.dtype = B, Hq, Hkv, L, S, D, causal, dtype

    def __repr__(self):
        return (f"B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-L{self.L}-S{self.S}-D{self.D}-"
                f"{'causal' if self.causal else 'full'}-{str(self.dtype).split('.')[-1]}")

    def arrays(self, seed=0):
        k = mx.random.split(mx.random.key(seed), 3)
        q = (mx.random.normal((self.B, self.Hq, self.L, self.D), key=k[0]) * 1.5).astype(self.dtype)
        kk = (mx.random.normal((self.B, self.Hkv, self.S, self.D), key=k[1]) * 1.5).astype(self.dtype)
        v = mx.random.normal((self.B, self.Hkv, self.S, self.D), key=k[2]).astype(self.dtype)
        return q, kk, v

    @property
    def mask(self):
        return "causal" if self.causal else None

    def expected(self, q, k, v):
        """The float32 reference: the kernel rounds P to 16 bits for its P V product and the output once."""
        with mx.stream(mx.cpu):
            out = reference.attention(q.astype(F32), k.astype(F32), v.astype(F32), scale=self.D**-0.5, mask=self.mask)
            mx.eval(out)
        return out


TOL = 1e-2  # 16-bit q, k, v, P and output against the float32 reference: a few bf16 ulps


def _check(case, got, want):
    assert got.shape == want.shape and got.dtype == case.dtype
    assert not mx.isnan(got.astype(F32)).any().item(), f"{case}: unwritten (NaN) output"
    err = _rel(got, want)
    assert err < TOL, f"{case}: rel err {err:.2e}"
    return err


# ---- the Metal source on the CPU (shim emulator) -------------------------------------------------

# GQA 3:1 and 1:1; L not a multiple of the 64-query tile, S past L (a cached prefix) and not a multiple of the
# key step; causal and full; head dims 32, 48 and 80 (not a multiple of 32); bf16 and f16; key steps 16 and 32.
EMULATED = [
    (Case(1, 3, 1, 70, 100, 48, True), 32),
    (Case(2, 2, 2, 17, 17, 32, False, F16), 16),
    (Case(1, 2, 1, 5, 40, 80, True), 16),
    (Case(1, 1, 1, 64, 64, 32, True, F16), 32),
]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_flash_attn_metal_emulated_matches_reference(tmp_path):
    emu, expected = Emulator(tmp_path), []
    for c, (case, BK) in enumerate(EMULATED):
        q, k, v = case.arrays(c)
        inst = fa.instance(case.dtype, case.B, case.Hq, case.Hkv, case.L, case.S, case.D, case.causal,
                           case.D**-0.5, BK)
        emu.add(fa.SPEC, inst, [q, k, v], *fa.grid(case.B, case.Hq, case.L), [q.shape])
        expected.append(case.expected(q, k, v))
    errs = {repr(c): _check(c, got[0], want) for (c, _), got, want in zip(EMULATED, emu.run(), expected)}
    print("rel err vs the float32 reference:", errs)


# ---- GPU: the kernel through MLX ------------------------------------------------------------------

GPU_CASES = [c for c, _ in EMULATED] + [
    Case(2, 4, 2, 150, 150, 64, True),  # the embedded lily-tiny
    Case(1, 16, 2, 1, 300, 256, True),  # one query over a long prefix
    Case(1, 16, 2, 65, 65, 256, False, F16),
] + [Case(1, 16, 2, L, S, 256, True) for L, S in ((63, 63), (64, 64), (65, 65), (2048, 2048), (512, 2560))]


def _gpu(backend, case):
    q, k, v = case.arrays()
    got = fa.attention(q, k, v, scale=case.D**-0.5, mask=case.mask, backend=backend, init_value=float("nan"))
    assert got is not None, f"flash_attn declined {case}"
    mx.eval(got)
    _check(case, got, case.expected(q, k, v))


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_flash_attn_cuda(case):
    _gpu("cuda", case)


@pytest.mark.metal
@pytest.mark.parametrize("case", GPU_CASES, ids=repr)
def test_flash_attn_metal(case):
    _gpu("metal", case)


def _model_prefill_on_vs_off(monkeypatch):
    monkeypatch.setattr(ops, "FLASH_MIN_SCORES", 0)  # the embedded model's prompts are far below the rule
    model, _ = lily_mlx.load_model(EMBEDDED_MODEL, dtype=mx.bfloat16)
    prompt = mx.random.randint(0, 256, (1, 150), key=mx.random.key(3))
    runs = []
    for on in (False, True):
        with ops.switched("flash_attn", on):
            cache = model.make_cache()
            first = model(prompt[:, :100], cache=cache)  # then 50 more: a prefix already in the cache
            rest = model(prompt[:, 100:], cache=cache)
            runs.append(mx.concatenate([first, rest], axis=1).astype(F32))
    err = _rel(runs[1], runs[0])
    assert err < 2e-2, f"prefill logits with flash_attn: rel err {err:.2e}"


@pytest.mark.cuda
def test_model_prefill_with_flash_attn_cuda(monkeypatch):
    _model_prefill_on_vs_off(monkeypatch)


@pytest.mark.metal
def test_model_prefill_with_flash_attn_metal(monkeypatch):
    _model_prefill_on_vs_off(monkeypatch)


# ---- CPU: declines and the dispatcher -------------------------------------------------------------

def test_unsupported_arguments_are_declined():
    q, k, v = Case(1, 4, 2, 8, 12, 64).arrays()
    assert fa.unsupported(q, k, v, "causal") is None and fa.unsupported(q, k, v, None) is None
    assert "shapes" in fa.unsupported(q[0], k, v, None)
    assert "dtypes" in fa.unsupported(q.astype(F32), k.astype(F32), v.astype(F32), None)
    assert "mask" in fa.unsupported(q, k, v, mx.ones((8, 12), dtype=mx.bool_))
    assert "kv heads" in fa.unsupported(q[:, :3], k, v, None)
    assert "head_dim" in fa.unsupported(q[..., :40], k[..., :40], v[..., :40], None)
    wide = Case(1, 1, 1, 4, 4, 288).arrays()
    assert "head_dim" in fa.unsupported(*wide, None)
    assert "last L" in fa.unsupported(q, k[:, :, :4], v[:, :, :4], None)
    assert fa.attention(*wide, scale=0.1, backend="cuda") is None


def test_key_step_fits_shared_memory():
    for backend in ("cuda", "metal"):
        for D in (32, 64, 128, 256):
            BK = fa.keys_per_step(D, backend)
            assert fa.shared_bytes(D, BK) <= fa.SHARED_BYTES[backend]
    assert fa.keys_per_step(256, "cuda") == 32 and fa.keys_per_step(256, "metal") == 16


def test_dispatch_takes_the_kernel_from_its_score_count_when_switched_on(monkeypatch):
    calls = []
    monkeypatch.setitem(ops._kernels, "flash_attn", lambda *a, **kw: calls.append(kw) or None)
    q, k, v = Case(1, 4, 2, 8, 12, 64).arrays()  # 4 * 8 * 12 = 384 scores
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    want = reference.attention(q, k, v, scale=0.125, mask="causal")
    assert ops.enabled("flash_attn")  # on by default
    monkeypatch.setattr(ops, "FLASH_MIN_SCORES", 385)
    ops.attention(q, k, v, scale=0.125, mask="causal")
    assert calls == []  # below the rule: MLX's attention
    monkeypatch.setattr(ops, "FLASH_MIN_SCORES", 384)
    with ops.switched("flash_attn", False):
        ops.attention(q, k, v, scale=0.125, mask="causal")
    assert calls == []
    got = ops.attention(q, k, v, scale=0.125, mask="causal")  # the kernel declines: the reference
    assert calls == [{"scale": 0.125, "mask": "causal"}] and mx.array_equal(got, want).item()
