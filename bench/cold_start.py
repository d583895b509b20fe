"""What a fresh process pays before it decodes: MLX builds every custom CUDA kernel with NVRTC in every process (it
reads its on-disk cache for them but never writes them to it); `kernel_cache` writes them there (ops/kernel_cache.py).

Each arm is a new process running a short decode profile (`bench.profile_decode --steps 4`: load, prefill, compile,
decode) with MLX's cache in a fresh folder, run twice on that folder: the first process finds nothing built, the
second finds MLX's own kernels (which MLX stores) and, with kernel_cache on, ours. Wall time of each process, and the
builds on disk after it.

    python -m bench.cold_start --model PATH [--arms off on] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_arm(model: str, arm: str, folder: Path, context: int) -> dict:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder))
    for var, named in (("LILY_MLX_ENABLE", arm == "on"), ("LILY_MLX_DISABLE", arm == "off")):
        rest = [s for s in env.get(var, "").split(",") if s and s != "kernel_cache"]
        env[var] = ",".join(rest + (["kernel_cache"] if named else []))
    cmd = [sys.executable, "-m", "bench.profile_decode", "--model", model, "--context", str(context), "--steps", "4",
           "--no-ops"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"cold_start: {arm} arm failed:\n{r.stderr[-3000:]}")
    return {"kernel_cache": arm, "wall_s": wall, "builds_on_disk": sum(1 for _ in folder.rglob("*.ptx"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--arms", nargs="+", choices=("off", "on"), default=["off", "on"])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    rows = []
    for arm in args.arms:
        with tempfile.TemporaryDirectory(prefix=f"cold_start_{arm}_") as d:
            for attempt in ("empty cache", "filled by the first"):
                row = {**run_arm(args.model, arm, Path(d), args.context), "process": attempt}
                rows.append(row)
                print(f"kernel_cache {arm:3} {attempt:20} {row['wall_s']:7.1f} s, {row['builds_on_disk']} builds on disk",
                      flush=True)
    if args.json_path:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.json_path).write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit,
                                                    "model": args.model, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
