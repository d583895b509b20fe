"""deltanet_chain_out at B 3 float32 (the 35B heads) in one process: which rows come out wrong against the CPU
reference, and the launch's outputs saved for a look on the CPU (out, proj, h, the first 4 heads of the state).
Runs 54-55 ran it in fresh processes under each build (kernel_cache's, built then loaded; MLX's own, loading
kernel_cache's file or building): every row right. LEAD=0F,0T,1F runs the diag's launches before it in its order
(case index, T/F: with the output projection).
    python kernels/scratch/deltanet_chain_out_b3.py LABEL [OUT]
"""
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[2] / "tests")]
from lily_mlx.ops import deltanet_chain as dc, kernel_cache  # noqa: E402
from test_deltanet_chain import MODEL, _inputs, _out_proj  # noqa: E402
from test_deltanet_step import _composition  # noqa: E402

label, out_dir = sys.argv[1], Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "."))
F32 = mx.float32


def launch(case, K, bits, gs, with_out=True):
    x, norm, in_proj, params, conv_state, state, mask = _inputs(case, K, bits, gs)
    r = dc.step(x, norm, in_proj, params[0], conv_state, params[1], params[2], params[3], state,
                num_key_heads=case.Hk, eps=case.eps, mask=mask, out_proj=_out_proj(case, K) if with_out else None,
                residual=x if with_out else None, backend="cuda", init_value=float("nan"))
    mx.eval(r)
    return r, (x, params, conv_state, state, mask)


# LEAD: what runs first, as (case, with_out) pairs: the diag's order is 0F,0T,1F
for item in filter(None, os.environ.get("LEAD", "").split(",")):
    for _ in range(3):
        launch(*MODEL[int(item[0])], with_out=item[1] == "T")
case, K, bits, gs = MODEL[1]
runs = [launch(case, K, bits, gs) for _ in range(2)]
(out, conv_new, state_new, proj, h), (x, params, conv_state, state, mask) = runs[0]
same = all(mx.array_equal(a, b, equal_nan=True).item() for a, b in zip(runs[0][0], runs[1][0]))
o_ref, c_ref, s_ref = _composition(case, (proj, mask), params, conv_state, state, upcast=True)
o, orf = out.reshape(case.B, -1), o_ref.reshape(case.B, -1)
errs = [(mx.linalg.norm(o[b] - orf[b]) / mx.linalg.norm(orf[b])).item() for b in range(case.B)]
serrs = [(mx.linalg.norm((state_new[b] - s_ref[b]).flatten()) / mx.linalg.norm(s_ref[b].flatten())).item()
         for b in range(case.B)]
print(f"{label}: cache {dict(kernel_cache.stats)}, launches bit-equal {same}, out rel by row "
      f"{', '.join(f'{e:.1e}' for e in errs)}, state rel by row {', '.join(f'{e:.1e}' for e in serrs)}")
np.savez_compressed(out_dir / f"b3_{label}.npz", out=np.array(out), proj=np.array(proj), h=np.array(h),
                    state4=np.array(state_new[:, :4]), conv=np.array(conv_new))
