"""Why the embedded model's decode logits moved with chain_prefetch on (H100 run 38: moe_chain 0.71, attn_chain 0.88
rel err; deltanet_chain_out bit-equal). For each chain, on its own: five decodes (prefetch off, off, on, on, off)
against the first, per step, with the greedy tokens; then one layer's chain launch from the first decode step
replayed 8 times with prefetch off and 8 with it on, bit-compared with the first replay. A run-to-run difference
with prefetch off says the chain itself is not deterministic; a difference only with it on blames the hints.

    python kernels/scratch/chain_prefetch_diag.py [--dtype float32|bfloat16] [--chains moe_chain attn_chain ...]
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lily_mlx import ops  # noqa: E402
from tests.switch_ab import _model, _tokens  # noqa: E402


def decode(model, toks, steps):
    cache = model.make_cache()
    model(toks, cache=cache)
    tok, out, ids = toks[:, -1:], [], []
    for _ in range(steps):
        logits = model(tok, cache=cache)[:, -1]
        tok = mx.argmax(logits, axis=-1)[:, None]
        out.append(logits.astype(mx.float32))
        ids.append(tok.item())
    return out, ids


def rel(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chains", nargs="+", default=["moe_chain", "attn_chain", "deltanet_chain_out"])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model, toks = _model(getattr(mx, args.dtype)), _tokens(40)
    for chain in args.chains:
        real, captured = ops._kernels[chain], []

        def spy(*a, **k):
            out = real(*a, **k)
            if len(captured) < 1:
                mx.eval(out)
                captured.append((a, k, out))
            return out

        with ops.switched(chain, True):
            first = None
            for pf in (False, False, True, True, False):
                with ops.switched("chain_prefetch", pf):
                    ops._kernels[chain] = spy
                    try:
                        logits, ids = decode(model, toks, args.steps)
                    finally:
                        ops._kernels[chain] = real
                if first is None:
                    first = logits
                errs = " ".join(f"{rel(a, b):.1e}" for a, b in zip(logits, first))
                print(f"{chain} {args.dtype} prefetch {'on ' if pf else 'off'}: tokens {ids} rel err by step {errs}",
                      flush=True)
            if not captured:
                print(f"  {chain}: no launch captured (not on a GPU backend?)")
                continue
            a, k, ref = captured[0]
            for pf in (False, True):
                with ops.switched("chain_prefetch", pf):
                    diffs = []
                    for _ in range(8):
                        out = real(*a, **k)
                        outs = out if isinstance(out, (tuple, list)) else (out,)
                        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
                        diffs.append(sum(not mx.array_equal(o, r, equal_nan=True).item() for o, r in zip(outs, refs)))
                print(f"  replay of the first captured launch, prefetch {'on ' if pf else 'off'}: outputs differing "
                      f"from the capture in 8 replays: {diffs}", flush=True)


if __name__ == "__main__":
    main()
