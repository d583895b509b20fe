"""One arm of the A/B bench, in a process of its own: load the model once, then run the trials the parent
sends (JSON lines on stdin) and answer each with a JSON line on the original stdout. Everything else the
libraries print goes to stderr.

Arms: `stock` (mlx_lm.load + mlx-lm's loop), `lily` (lily_mlx.load + lily_mlx.generate), the hybrids
`lily-model+stock-loop` and `stock-model+lily-loop`, `lily-no-<switch>[+<switch>...]` (lily with
switches of lily_mlx.ops.KERNEL_NAMES off, through LILY_MLX_DISABLE), and `lily-with-<switch>[+<switch>...]` (lily
with switches that are off by default opted in, through LILY_MLX_ENABLE). Both loops are called with mlx-lm 0.32.2's
signatures: stream_generate for batch 1, batch_generate above.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ARMS = {
    "stock": ("stock", "stock"),
    "lily": ("lily", "lily"),
    "lily-model+stock-loop": ("lily", "stock"),
    "stock-model+lily-loop": ("stock", "lily"),
}
NO_PREFIX = "lily-no-"
WITH_PREFIX = "lily-with-"
# Test hook: "ARM:ROUND:FACTOR" (ARM may be *) multiplies that round's measured times by FACTOR.
PERTURB_ENV = "LILY_BENCH_PERTURB"


class ArmError(ValueError):
    pass


def parse_arm(name: str) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """Arm name -> (model engine, loop engine, kernel switches turned off, switches opted into)."""
    if name in ARMS:
        return (*ARMS[name], (), ())
    if name.startswith(NO_PREFIX) and all(name[len(NO_PREFIX):].split("+")):
        return "lily", "lily", tuple(name[len(NO_PREFIX):].split("+")), ()
    if name.startswith(WITH_PREFIX) and all(name[len(WITH_PREFIX):].split("+")):
        return "lily", "lily", (), tuple(name[len(WITH_PREFIX):].split("+"))
    raise ArmError(f"unknown arm {name!r}; arms: {', '.join(ARMS)}, {NO_PREFIX}<switch>[+<switch>...] for switches "
                   f"off, or {WITH_PREFIX}<switch>[+<switch>...] for default-off switches on")


def arm_env(name: str) -> dict[str, str]:
    """Environment an arm's process runs under; the parent's own switches never leak into an arm."""
    _, _, off, on = parse_arm(name)
    return {"LILY_MLX_DISABLE": ",".join(off), "LILY_MLX_ENABLE": ",".join(on)}


LILY_LOOP_MISSING = (
    "lily_mlx.generate is not available (lily_mlx/generate.py is missing): the 'lily', 'lily-no-*' and "
    "'stock-model+lily-loop' arms need it; 'stock' and 'lily-model+stock-loop' do not"
)


def has_lily_loop() -> bool:
    """Without importing it: importing lily_mlx.generate rebinds the package's `generate` function to the module."""
    return importlib.util.find_spec("lily_mlx.generate") is not None


def loop_module(engine: str):
    # import_module, not `import a.generate as g`: the packages export a function of that name too.
    if engine == "stock":
        return importlib.import_module("mlx_lm.generate")
    try:
        loop = importlib.import_module("lily_mlx.generate")
    except ModuleNotFoundError as e:
        if e.name != "lily_mlx.generate":
            raise
        raise ArmError(LILY_LOOP_MISSING) from None
    for fn in ("stream_generate", "batch_generate"):
        if not callable(getattr(loop, fn, None)):
            raise ArmError(f"lily_mlx.generate has no {fn}() with mlx-lm's signature")
    return loop


DTYPES = ("float32", "bfloat16", "float16")


def load(engine: str, path: str, dtype: Optional[str] = None):
    """(model, tokenizer) of one engine. dtype casts every floating parameter after loading, the same
    in both engines (float32 lets stock mlx-lm run a bf16 MoE checkpoint on MLX's CPU, whose expert
    matmul is float32-only)."""
    if engine == "stock":
        import mlx_lm

        model, tokenizer = mlx_lm.load(path)
    else:
        import lily_mlx

        model, tokenizer = lily_mlx.load(path)
        model.pop("mtp", None)  # stock mlx-lm drops the MTP head on load: both arms hold the same weights
    if dtype is not None:
        import mlx.core as mx

        model.set_dtype(getattr(mx, dtype))
        if engine != "stock":
            model.fuse_projections()  # the cast replaced the arrays the fused projections were built from
    return model, tokenizer


def prompts(seed: int, batch: int, length: int, vocab: int):
    """The same random prompt ids in every arm: [batch, length] from (seed, batch, length)."""
    import numpy as np

    rng = np.random.default_rng([seed, batch, length])
    return rng.integers(0, vocab, size=(batch, length))


def digest(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def _perturbation(arm: str, round_index: int) -> float:
    spec = os.environ.get(PERTURB_ENV, "")
    for item in filter(None, spec.split(",")):
        who, r, factor = item.rsplit(":", 2)
        if who in ("*", arm) and int(r) == round_index:
            return float(factor)
    return 1.0


def cpu_ticks(stat: Path = Path("/proc/stat")) -> Optional[tuple[int, int]]:
    """(steal, total) jiffies over all CPUs since boot, from Linux's /proc/stat (None elsewhere): the time a
    hypervisor ran other guests on this VM's CPUs."""
    try:
        fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7], sum(fields[:8])) if len(fields) >= 8 else None


def run_trial(model, tokenizer, loop, vocab: int, p: int, g: int, b: int, seed: int, prefill_step: int) -> dict[str, Any]:
    """One timed generation. Python's cyclic GC is held off while it runs (in every arm alike): a collection
    in the middle of a CPU-bound decode loop is one of the larger sources of round-to-round spread. Also
    reported: the CPU time this process used and the share of all CPUs' time the hypervisor stole, which tell
    a slower machine from a slower engine when rounds spread."""
    gc.collect()
    gc.disable()
    before, cpu0 = cpu_ticks(), time.process_time()
    try:
        out = _trial(model, tokenizer, loop, vocab, p, g, b, seed, prefill_step)
    finally:
        gc.enable()
    after = cpu_ticks()
    out["process_cpu_s"] = time.process_time() - cpu0
    if before and after:  # no jiffy elapsed (a trial under ~10 ms): nothing could be stolen either
        out["steal_pct"] = 100 * (after[0] - before[0]) / max(1, after[1] - before[1])
    return out


def _trial(model, tokenizer, loop, vocab: int, p: int, g: int, b: int, seed: int, prefill_step: int) -> dict[str, Any]:
    import mlx.core as mx

    ids = prompts(seed, b, p, vocab)
    mx.clear_cache()
    mx.reset_peak_memory()
    if b == 1:
        t0 = time.perf_counter()
        stamps, tokens, last = [], [], None
        for r in loop.stream_generate(model, tokenizer, mx.array(ids[0]), max_tokens=g, prefill_step_size=prefill_step):
            stamps.append(time.perf_counter())
            tokens.append(int(r.token))
            last = r
        end = time.perf_counter()
        if not stamps:
            raise ArmError("the loop yielded no tokens")
        ttft, decode_time = stamps[0] - t0, end - stamps[0]
        out = {"tokens": [tokens], "ttft_s": ttft, "decode_time_s": decode_time, "decode_tokens": len(tokens) - 1}
        if len(stamps) > 1:  # per-token gaps tell a stall (a high max) from a slower CPU (a higher median)
            gaps = sorted(1e3 * (b - a) for a, b in zip(stamps, stamps[1:]))
            out["decode_gap_ms"] = {q: gaps[min(len(gaps) - 1, int(f * len(gaps)))]
                                    for q, f in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("max", 1.0))}
        out["reported"] = {k: getattr(last, k, None) for k in ("prompt_tps", "generation_tps", "peak_memory")}
    else:
        t0 = time.perf_counter()
        res = loop.batch_generate(
            model, tokenizer, ids.tolist(), max_tokens=g, return_token_ids=True, prefill_step_size=prefill_step,
            prefill_batch_size=b, completion_batch_size=b,
        )
        wall = time.perf_counter() - t0
        stats = res.stats
        tokens = [[int(t) for t in row] for row in res.token_ids]
        # The batch's prefill time stands for its time to first token; decode is the rest of the wall time.
        ttft = float(stats.prompt_time)
        out = {"tokens": tokens, "ttft_s": ttft, "decode_time_s": float(stats.generation_time),
               "decode_tokens": int(stats.generation_tokens), "batch_wall_s": wall}
        out["reported"] = {k: getattr(stats, k, None) for k in ("prompt_tps", "generation_tps", "peak_memory")}
    out["peak_memory_gb"] = mx.get_peak_memory() / 1e9
    return out


def _finish(out: dict, p: int, b: int, factor: float) -> dict:
    out["ttft_s"] *= factor
    out["decode_time_s"] *= factor
    out["decode_gap_ms"] = {q: factor * v for q, v in out.get("decode_gap_ms", {}).items()} or None
    out["prefill_tps"] = p * b / out["ttft_s"]
    out["decode_tps"] = out["decode_tokens"] / out["decode_time_s"] if out["decode_time_s"] > 0 else float("nan")
    out["digest"] = digest(out["tokens"])
    out["distinct_tokens"] = len({t for row in out["tokens"] for t in row})
    if factor != 1.0:
        out["perturbed_by"] = factor
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one bench arm (started by bench.ab)")
    ap.add_argument("--arm", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--dtype", choices=DTYPES)
    args = ap.parse_args(argv)
    # The protocol keeps the real stdout; anything printed (Python or C) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(**msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        model_engine, loop_engine, switched_off, opted_in = parse_arm(args.arm)
        loop = loop_module(loop_engine)
        t0 = time.perf_counter()
        model, tokenizer = load(model_engine, args.model, args.dtype)
        load_s = time.perf_counter() - t0
        tokenizer.eos_token_ids = []  # as mlx_lm.benchmark: never stop early
        import mlx.core as mx
        import mlx_lm

        kernels = {}
        if "lily" in (model_engine, loop_engine):  # the stock arm never imports lily_mlx
            from lily_mlx import ops

            for switch in switched_off:
                if switch != "all" and switch not in ops.KERNEL_NAMES:
                    raise ArmError(f"arm {args.arm}: no kernel switch {switch!r} on backend {ops.backend()}; "
                                   f"registered: {sorted(ops.KERNEL_NAMES) or 'none'}")
                if ops.enabled(switch if switch != "all" else "any kernel"):
                    raise ArmError(f"arm {args.arm}: LILY_MLX_DISABLE did not switch {switch!r} off")
            for name in opted_in:
                if name not in ops.KERNEL_NAMES or not ops.enabled(name):
                    raise ArmError(f"arm {args.arm}: kernel switch {name!r} is not registered or did not switch on "
                                   f"(registered: {sorted(ops.KERNEL_NAMES) or 'none'})")
            kernels = {"kernels": sorted(ops.KERNEL_NAMES), "kernels_off": sorted(n for n in ops.KERNEL_NAMES if not ops.enabled(n))}
        backend = ("cpu" if mx.default_device() == mx.cpu else "metal" if mx.metal.is_available()
                   else "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "cpu")

        raw = json.loads((Path(args.model) / "config.json").read_text())
        vocab = raw.get("text_config", raw)["vocab_size"]
        send(event="ready", arm=args.arm, load_s=load_s, model_engine=model_engine, loop_engine=loop_engine,
             loop_module=loop.__name__, backend=backend, vocab=vocab, **kernels,
             device_info={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in mx.device_info().items()},
             mlx=mx.__version__, mlx_lm=mlx_lm.__version__, pid=os.getpid(),
             cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    except Exception as e:
        send(event="error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        try:
            p, g, b = cmd["prompt_tokens"], cmd["generation_tokens"], cmd["batch_size"]
            out = run_trial(model, tokenizer, loop, vocab, p, g, b, cmd["seed"], args.prefill_step_size)
            factor = 1.0 if cmd.get("warmup") else _perturbation(args.arm, cmd["round"])
            send(event="result", **_finish(out, p, b, factor))
        except Exception as e:
            send(event="error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    return 0


if __name__ == "__main__":
    sys.exit(main())
