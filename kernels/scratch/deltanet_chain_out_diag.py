"""Why test_chain_prefetch_cuda[B3 float32 model shape, with_out] failed twice in run 45 (out rel err 0.23, plain
launch, no prefetch) yet passed in run 45's first process: per batch row and head, the step output's and state's error
against the CPU reference, for deltanet_chain and deltanet_chain_out at the model's shape, B1 bf16 and B3 float32,
three launches each, and whether kernel_cache loaded or built each instance. Run 57 found the kernel right and the
reference wrong (one row, 3 of 4 processes); the tests' reference now starts from host copies with the mixer's plain
ops, and this also prints the rows the old one (the GPU's arrays, compiled pieces on) gets wrong.
    python kernels/scratch/deltanet_chain_out_diag.py
"""
import sys
from pathlib import Path

import mlx.core as mx

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]
from lily_mlx import ops  # noqa: E402
from lily_mlx.ops import deltanet_chain as dc, kernel_cache, reference  # noqa: E402
from test_deltanet_chain import MODEL, _inputs, _out_proj, _matmul_ref  # noqa: E402
from test_deltanet_step import _composition  # noqa: E402

F32 = mx.float32


def rel(a, b, axis=None):
    a, b = a.astype(F32), b.astype(F32)
    if axis is None:
        return (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()
    return (mx.sqrt(((a - b) ** 2).sum(axis)) / mx.sqrt((b ** 2).sum(axis)))


for (case, K, bits, gs) in MODEL:
    for with_out in (False, True):
        x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
        out_proj = _out_proj(case, K) if with_out else None
        runs = []
        for _ in range(3):
            before = dict(kernel_cache.stats)
            r = dc.step(x, norm, in_proj, params[0], conv_state, params[1], params[2], params[3], state,
                        num_key_heads=case.Hk, eps=case.eps, mask=mask, out_proj=out_proj,
                        residual=x if with_out else None, backend="cuda", init_value=float("nan"))
            mx.eval(r)
            runs.append(r)
        cache = {k: kernel_cache.stats[k] - before.get(k, 0) for k in kernel_cache.stats}
        out, conv_new, state_new, proj = runs[0][:4]
        o_ref, c_ref, s_ref = _composition(case, (proj, mask), params, conv_state, state, upcast=True)
        same = all(all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(runs[0], r)) for r in runs[1:])
        o = out.reshape(case.B, case.Hv, case.Dv)
        orf = o_ref.reshape(case.B, case.Hv, case.Dv)
        per_head = rel(o, orf, axis=-1)  # [B, Hv]
        st = rel(state_new, s_ref, axis=(-1, -2))  # [B, Hv]
        print(f"{case} with_out={with_out} cache(last launch)={cache} runs bit-equal={same}")
        with mx.stream(mx.cpu):
            xn = reference.rms_norm(x, norm[0], norm[1])
        print(f"  proj rel {rel(proj, _matmul_ref(xn, in_proj)):.2e}; out rel {rel(out, o_ref):.2e}; "
              f"state rel {rel(state_new, s_ref):.2e}; conv equal {mx.array_equal(conv_new, c_ref.astype(conv_new.dtype)).item()}")
        for b in range(case.B):
            bad = [h for h in range(case.Hv) if per_head[b, h].item() > 1e-3]
            print(f"  row {b}: out rel {rel(o[b], orf[b]):.2e}, heads off {bad}, state heads off "
                  f"{[h for h in range(case.Hv) if st[b, h].item() > 1e-4]}")
        if with_out:
            h_ref = x.astype(F32) + _matmul_ref(out, out_proj)
            print(f"  h rel {rel(runs[0][4], h_ref):.2e}")
        # The reference as the tests took it before run 57: from the GPU's arrays, the mixer's compiled pieces on.
        with mx.stream(mx.cpu):
            o_old = ops.deltanet_mix(proj.astype(F32), params[0].astype(proj.dtype).astype(F32), conv_state.astype(F32),
                                     *(a.astype(F32) for a in params[1:]), state, num_key_heads=case.Hk, eps=case.eps,
                                     mask=mask)[0]
            mx.eval(o_old)
        old = rel(o, o_old.reshape(o.shape), axis=(-1, -2))
        print(f"  the old reference's rows off: {[b for b in range(case.B) if old[b].item() > 1e-3]}")
