"""A/B throughput bench against stock mlx-lm on identical weights, fail-closed.

    python -m bench.ab --model random:35b-a3b -p 512 -g 128 --arms stock,lily
    lily-mlx bench --model mlx-community/Qwen3.6-35B-A3B-4bit -p 256 4096 32768 -b 1 4 16 --json out.json

Method: each arm runs in its own fresh process (`bench.arm`) that loads the model once; every row of the
matrix (prompt length x decode length x batch size) gets warm-up trials, then N rounds whose arm order
alternates; the median of the rounds is reported. A row is refused when an arm's prefill or decode
throughput spreads more than --max-drift ((max - min) / median) across rounds, or when an arm's greedy
tokens differ between rounds or from the baseline arm's (the report names the first diverging step). A refused
row with agreeing tokens still states the ratio no round contradicts: the arm's slowest round against the
baseline's fastest, up to its fastest against the baseline's slowest; and each throughput whose rounds agree in
every arm stands by itself (the row's `claims`: "refused; decode stands").
`--isolation round` starts a fresh process per arm per round instead (one model in memory at a time).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import itertools
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from . import arm as arm_mod
from . import random_model

SCHEMA = "lily-mlx-bench/1"
METRICS = ("prefill_tps", "ttft_s", "decode_tps", "peak_memory_gb")
DRIFT_METRICS = ("prefill_tps", "decode_tps")


class BenchError(RuntimeError):
    pass


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lily-mlx bench", description=__doc__.split("\n\n")[0],
                                 epilog="--kernels runs the kernel microbenchmarks (bench/kernels.py) with the remaining flags")
    ap.add_argument("--model", default="random:" + random_model.DEFAULT_SHAPE,
                    help="model folder, hub repo, or random:<shape>[,key=value...] with shape in " + ", ".join(random_model.SHAPES))
    ap.add_argument("--model-dir", help="folder where a random model is built, or reused when already complete")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of a random model")
    ap.add_argument("--random-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of a random model's scales, biases and norms")
    ap.add_argument("--prompt-tokens", "-p", type=int, nargs="+", default=[512], help="prompt length(s)")
    ap.add_argument("--generation-tokens", "-g", type=int, nargs="+", default=[128], help="decode length(s)")
    ap.add_argument("--batch-size", "-b", type=int, nargs="+", default=[1], help="batch size(s)")
    ap.add_argument("--num-trials", "-n", type=int, default=5, help="timed rounds per row (>= 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed trials per arm before each row's rounds")
    ap.add_argument("--arms", default="stock,lily",
                    help="comma list: stock, lily, lily-model+stock-loop, stock-model+lily-loop, "
                         "lily-no-<switch>[+<switch>...] (switches off), lily-no-each (one arm per kernel switch), "
                         "lily-with-<switch>[+<switch>...] (default-off switches on)")
    ap.add_argument("--max-drift", type=float, default=0.03, help="refuse a row whose rounds spread more than this")
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--dtype", choices=arm_mod.DTYPES,
                    help="cast both engines' floating parameters after loading (float32: stock mlx-lm on a CPU "
                         "with a bf16 MoE checkpoint)")
    ap.add_argument("--isolation", choices=("arm", "round"), default="arm",
                    help="a fresh process per arm for the whole run (default) or per arm and round")
    ap.add_argument("--cpus", default="auto",
                    help="CPUs the arm processes are pinned to: auto (the GPU's NUMA-local CPUs where Linux names a "
                         "proper subset, else none), none, or a list such as 0-7,16")
    ap.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompt token ids")
    ap.add_argument("--trial-timeout", type=float, default=1800.0, help="seconds before a silent arm is declared hung")
    ap.add_argument("--json", dest="json_path", help="write the full report here")
    ap.add_argument("--markdown", help="write the markdown table here")
    ap.add_argument("--plot", help="write PNG plots here (throughput vs context length, speedup bars)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def expand_arms(spec: str) -> list[str]:
    arms: list[str] = []
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name == arm_mod.NO_PREFIX + "each":
            from lily_mlx import ops

            if not ops.KERNEL_NAMES:
                raise BenchError(f"--arms {name}: no kernel switches are registered on backend {ops.backend()}")
            arms += [arm_mod.NO_PREFIX + k for k in sorted(ops.KERNEL_NAMES)]
        else:
            arm_mod.parse_arm(name)
            arms.append(name)
    if len(arms) < 1 or len(set(arms)) != len(arms):
        raise BenchError(f"--arms {spec!r}: give one or more distinct arms")
    if any(arm_mod.parse_arm(a)[1] == "lily" for a in arms) and not arm_mod.has_lily_loop():
        raise BenchError(arm_mod.LILY_LOOP_MISSING)  # fail now, not in every process
    return arms


def resolve_model(args) -> tuple[Path, Optional[dict]]:
    if args.model.startswith("random:"):
        path = random_model.ensure(args.model, args.model_dir, seed=args.seed, dtype=args.random_dtype, progress=None if not args.no_progress else False)
        return path, json.loads((path / random_model.MANIFEST).read_text())
    if args.model_dir:
        raise BenchError("--model-dir is for random:<shape> models; give the folder as --model")
    from lily_mlx.loading import resolve_model_path

    return resolve_model_path(args.model), None


def _child_env(arm: str) -> dict[str, str]:
    """The parent's environment, the arm's switches, and a PYTHONPATH that finds the same packages."""
    import lily_mlx

    top = importlib.import_module(__package__.split(".")[0])
    roots = [str(Path(top.__file__).resolve().parents[1]), str(Path(lily_mlx.__file__).resolve().parents[1])]
    env = dict(os.environ)
    env.update(arm_mod.arm_env(arm))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def parse_cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' (Linux's cpulist format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, (t.strip() for t in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise BenchError(f"--cpus {text!r}: expected a list such as 0-7,16")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(pci_root: Path = Path("/sys/bus/pci/devices")) -> Optional[set[int]]:
    """The CPUs on the first NVIDIA GPU's NUMA node, when they are a proper subset of the usable ones: an arm
    process the scheduler moves to the far node launches through the far socket, one source of round spread."""
    usable = os.sched_getaffinity(0)
    for dev in sorted(pci_root.glob("*")):
        try:
            if (dev / "vendor").read_text().strip() != "0x10de" or not (dev / "class").read_text().startswith("0x03"):
                continue
            local = parse_cpu_list((dev / "local_cpulist").read_text()) & usable
        except (OSError, BenchError):
            continue
        return local if local and local != usable else None
    return None


def resolve_cpus(spec: str) -> Optional[list[int]]:
    if spec == "none" or (spec == "auto" and not hasattr(os, "sched_setaffinity")):
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise BenchError(f"--cpus {spec}: pinning needs Linux's sched_setaffinity; give --cpus none")
    cpus = gpu_local_cpus() if spec == "auto" else parse_cpu_list(spec)
    if cpus is not None and not cpus <= os.sched_getaffinity(0):
        raise BenchError(f"--cpus {spec}: CPUs {sorted(cpus - os.sched_getaffinity(0))} are not usable here")
    return sorted(cpus) if cpus else None


class Stopped(Exception):
    """SIGTERM arrived: report the finished rows and kill the arm processes."""


def _raise_stopped(signum, frame):
    # timeout(1) signals the bench, then its whole process group, the bench again included: stop once.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Stopped()


class Worker:
    """One arm process; JSON lines in on stdin, out on stdout; its stderr goes to a log file."""

    def __init__(self, arm: str, model: Path, args, log_dir: Path):
        self.arm = arm
        self.log_path = log_dir / f"{arm}.{len(list(log_dir.glob(f'{arm}.*.log')))}.log"
        self.log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", f"{__package__}.arm", "--arm", arm, "--model", str(model),
               "--prefill-step-size", str(args.prefill_step_size)] + (["--dtype", args.dtype] if args.dtype else [])
        pin = (lambda: os.sched_setaffinity(0, args.cpu_set)) if args.cpu_set else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=_child_env(arm), preexec_fn=pin)
        self.timeout = args.trial_timeout
        self.info: dict = {}

    def _fail(self, why: str):
        self.close(kill=True)
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise BenchError(f"arm {self.arm}: {why}\n--- {self.log_path} (tail) ---\n{tail}")

    def recv(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self._fail(f"no answer in {self.timeout:.0f} s (--trial-timeout)")
        line = self.proc.stdout.readline()
        if not line:
            self._fail(f"process exited with code {self.proc.wait()}")
        msg = json.loads(line)
        if msg.get("event") == "error":
            self._fail(msg["message"] + "\n" + msg.get("traceback", ""))
        return msg

    def ready(self) -> dict:
        self.info = self.recv()
        return self.info

    def trial(self, **cmd) -> dict:
        self.proc.stdin.write((json.dumps({"cmd": "trial", **cmd}) + "\n").encode())
        self.proc.stdin.flush()
        return self.recv()

    def close(self, kill: bool = False):
        if self.proc.poll() is None:
            try:
                if not kill:
                    self.proc.stdin.write(b'{"cmd": "exit"}\n')
                    self.proc.stdin.flush()
                    self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    for seq, (x, y) in enumerate(zip(a, b)):
        for step, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return {"sequence": seq, "step": step, "tokens": [s, t]}
        if len(x) != len(y):
            return {"sequence": seq, "step": min(len(x), len(y)), "tokens": [None, None], "lengths": [len(x), len(y)]}
    return {"sequence": None, "step": None, "tokens": None, "lengths": [len(a), len(b)]}


def evaluate(p: int, g: int, b: int, trials: dict[str, list[dict]], baseline: str, max_drift: float, traffic) -> dict:
    """Medians, spreads, digests and ratios of one row; status 'refused' with reasons when it fails."""
    reasons, warnings = [], []
    # The throughputs whose claim fails: one whose rounds spread in some arm, both where tokens differ. A throughput
    # is its own claim: a 256-token prefill's noisy 0.1 s does not unsay a steady decode (run 92).
    refused: set[str] = set()
    bytes_step = traffic.per_step(b, p + g / 2) if traffic else None
    arms_out: dict[str, Any] = {}
    for arm, rounds in trials.items():
        median = {k: statistics.median(t[k] for t in rounds) for k in METRICS}
        spread = {}
        for k in DRIFT_METRICS:
            values = [t[k] for t in rounds]
            spread[k] = (max(values) - min(values)) / median[k] if median[k] > 0 else float("inf")
            if spread[k] > max_drift:
                refused.add(k)
                gaps = [t["decode_gap_ms"]["p50"] for t in rounds if k == "decode_tps" and t.get("decode_gap_ms")]
                steal = [t["steal_pct"] for t in rounds if "steal_pct" in t]
                notes = ([f"median token gap {', '.join(f'{x:.2f}' for x in gaps)} ms"] if gaps else []) + (
                    [f"CPU steal {', '.join(f'{x:.1f}' for x in steal)}%"] if len(steal) == len(rounds) else [])
                reasons.append(f"{arm}: {k} spreads {100 * spread[k]:.1f}% across rounds (limit {100 * max_drift:.1f}%): "
                               + ", ".join(f"{v:.1f}" for v in values) + (f" ({'; '.join(notes)})" if notes else ""))
        digests = [t["digest"] for t in rounds]
        if len(set(digests)) > 1:
            refused.update(DRIFT_METRICS)
            other = next(t for t in rounds if t["digest"] != digests[0])
            d = first_divergence(rounds[0]["tokens"], other["tokens"])
            reasons.append(f"{arm}: greedy tokens change between rounds (first at sequence {d['sequence']} step {d['step']}: {d['tokens']})")
        if min(t["distinct_tokens"] for t in rounds) <= 1:
            warnings.append(f"{arm}: greedy decoding emits a single repeated token")
        entry = {
            "median": median, "spread": spread, "digest": digests[0],
            "distinct_tokens": rounds[0]["distinct_tokens"],
            "rounds": [{k: t[k] for k in (*METRICS, "digest", "reported", "decode_gap_ms", "process_cpu_s", "steal_pct")
                        if k in t} for t in rounds],
        }
        if bytes_step:
            entry["bandwidth_gbps"] = bytes_step["total"] * median["decode_tps"] / b / 1e9
        arms_out[arm] = entry
    base = arms_out[baseline]
    divergence = {}
    for arm, entry in arms_out.items():
        m, bm = entry["median"], base["median"]
        entry["vs_baseline"] = {
            "decode": m["decode_tps"] / bm["decode_tps"],
            "prefill": m["prefill_tps"] / bm["prefill_tps"],
            "ttft": bm["ttft_s"] / m["ttft_s"],
        }
        # Informational, not a refusal rule: the ratio round by round (the arms of a round run back to back), which
        # would be steady if a machine's slow spells hit both arms of a round alike.
        ours = {k: [t[f"{k}_tps"] for t in trials[arm]] for k in ("decode", "prefill")}
        theirs = {k: [t[f"{k}_tps"] for t in trials[baseline]] for k in ("decode", "prefill")}
        paired = {k: [a / b for a, b in zip(ours[k], theirs[k])] for k in ours}
        entry["paired_ratios"] = {k: {"rounds": v, "spread": (max(v) - min(v)) / statistics.median(v)}
                                  for k, v in paired.items()}
        # What no round contradicts, however the rounds spread: this arm's slowest round against the baseline's
        # fastest, and its fastest against the baseline's slowest (a refused row's claim, as a range).
        entry["ratio_bounds"] = {k: [min(ours[k]) / max(theirs[k]), max(ours[k]) / min(theirs[k])] for k in ours}
        if arm != baseline and entry["digest"] != base["digest"]:
            d = first_divergence(trials[baseline][0]["tokens"], trials[arm][0]["tokens"])
            divergence[arm] = d
            refused.update(DRIFT_METRICS)
            reasons.append(f"{arm}: greedy tokens differ from {baseline} at sequence {d['sequence']} step {d['step']}: "
                           f"{baseline} {d['tokens'][0] if d['tokens'] else None} vs {arm} {d['tokens'][1] if d['tokens'] else None}")
    claims = {k.removesuffix("_tps"): "refused" if k in refused else "ok" for k in DRIFT_METRICS}
    return {
        "prompt_tokens": p, "generation_tokens": g, "batch_size": b,
        "status": "refused" if reasons else "ok", "claims": claims, "reasons": reasons, "warnings": warnings,
        "digests_agree": not divergence, "divergence": divergence,
        "bytes_per_decode_step": bytes_step, "arms": arms_out,
    }


def status_text(row: dict) -> str:
    """'ok', 'refused', or 'refused; decode stands' where only the other throughput's rounds spread."""
    standing = [k for k, v in row.get("claims", {}).items() if v == "ok"]
    return row["status"] if row["status"] == "ok" or not standing else f"refused; {' and '.join(standing)} stands"


def run_matrix(args, arms: list[str], model: Path, traffic) -> tuple[list[dict], dict]:
    from tqdm import tqdm

    rows = list(itertools.product(args.prompt_tokens, args.generation_tokens, args.batch_size))
    per_process_warmups = args.warmup * (1 if args.isolation == "arm" else args.num_trials)
    total = len(rows) * len(arms) * (args.num_trials + per_process_warmups)
    baseline = "stock" if "stock" in arms else arms[0]
    log_dir = Path(tempfile.mkdtemp(prefix="lily-bench-"))
    infos: dict[str, list[dict]] = {a: [] for a in arms}
    results = []
    bar = tqdm(total=total, unit="trial", desc="bench", disable=True if args.no_progress else None)
    workers: dict[str, Worker] = {}

    def spawn(arm):
        w = Worker(arm, model, args, log_dir)
        workers[arm] = w
        return w

    def order(r):
        return arms if r % 2 == 0 else arms[::-1]

    def trial(w, p, g, b, r, warmup=False):
        bar.set_postfix_str(f"p={p} g={g} b={b} {w.arm}{' warm-up' if warmup else f' round {r + 1}'}")
        out = w.trial(prompt_tokens=p, generation_tokens=g, batch_size=b, seed=args.prompt_seed, round=r, warmup=warmup)
        bar.update()
        return out

    stopped = False
    try:
        if args.isolation == "arm":
            for a in arms:
                spawn(a)  # all arms load at once
            for a in arms:
                infos[a].append(workers[a].ready())
                tqdm.write(f"{a}: loaded in {infos[a][-1]['load_s']:.1f} s ({infos[a][-1]['backend']})", file=sys.stderr)
        for p, g, b in rows:
            trials: dict[str, list[dict]] = {a: [] for a in arms}
            if args.isolation == "arm":
                for r in range(args.warmup):
                    for a in order(r):
                        trial(workers[a], p, g, b, -1, warmup=True)
            for r in range(args.num_trials):
                for a in order(r):
                    if args.isolation == "round":
                        w = spawn(a)
                        infos[a].append(w.ready())
                        for _ in range(args.warmup):
                            trial(w, p, g, b, -1, warmup=True)
                    trials[a].append(trial(workers[a], p, g, b, r))
                    if args.isolation == "round":
                        workers.pop(a).close()
            results.append(evaluate(p, g, b, trials, baseline, args.max_drift, traffic))
            row = results[-1]
            tqdm.write(f"p={p} g={g} b={b} [{status_text(row)}] " + "; ".join(
                f"{a} prefill {e['median']['prefill_tps']:.1f} decode {e['median']['decode_tps']:.1f} tok/s"
                for a, e in row["arms"].items()), file=sys.stderr)
    except Stopped:
        stopped = True  # keep the finished rows; the unfinished one is dropped, never reported half-measured
        tqdm.write(f"stopped by SIGTERM after {len(results)} of {len(rows)} rows", file=sys.stderr)
    finally:
        bar.close()
        for w in workers.values():
            w.close(kill=stopped)
    shutil.rmtree(log_dir, ignore_errors=True)
    return results, infos, stopped


def hardware(infos: dict) -> dict:
    hw: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        cpu = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
        hw["cpu"] = cpu.split(":", 1)[1].strip()
        mem = next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal"))
        hw["ram_gb"] = round(int(mem.split()[1]) / 1e6, 1)
    except (OSError, StopIteration):
        hw["cpu"] = platform.processor()
    first = next((i[0] for i in infos.values() if i), {})
    hw["backend"] = first.get("backend")
    hw["device_info"] = first.get("device_info")
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if q.returncode == 0:
            hw["gpus"] = [l.strip() for l in q.stdout.splitlines() if l.strip()]
            hw["gpu_name"] = hw["gpus"][0].split(",")[0] if hw["gpus"] else None
    if not hw.get("gpu_name") and hw["backend"] in ("cuda", "metal"):
        hw["gpu_name"] = (hw.get("device_info") or {}).get("device_name")
    return hw


SOURCE_DIRS = ("lily_mlx", "kernels", "bench")


def source_digest(root: Path) -> str:
    """sha256 prefix of the code that ran (every file under SOURCE_DIRS but caches): names the tree where a
    copied .git is stale or missing (a GPU lease's copy of the working tree). `python -m bench.ab --digest`
    prints it for a local checkout, to match a report against a commit."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_info() -> dict:
    root = Path(__file__).resolve().parents[1]
    info: dict[str, Any] = {"commit": None, "source_digest": source_digest(root)}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return info
    if commit.returncode == 0:
        info.update(commit=commit.stdout.strip(), dirty=bool(dirty.stdout.strip()))
    return info


def versions() -> dict:
    import mlx.core as mx
    import mlx_lm

    import lily_mlx

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "lily_mlx": lily_mlx.__version__, "python": platform.python_version()}


def _cpu_text(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def markdown(report: dict) -> str:
    base = report["baseline"]
    hw = report["hardware"]
    lines = [
        f"# lily-mlx bench: {report['model']['spec']}",
        "",
        f"{report['date']} · {hw.get('gpu_name') or hw.get('cpu')} ({hw.get('backend')}) · MLX {report['versions']['mlx']} · "
        f"mlx-lm {report['versions']['mlx_lm']} · commit {(report['git'].get('commit') or 'unknown')[:10]}"
        f"{' (dirty)' if report['git'].get('dirty') else ''} · source {report['git'].get('source_digest', '?')} · "
        f"{report['settings']['num_trials']} rounds, median, "
        f"max drift {100 * report['settings']['max_drift']:.1f}%"
        f"{' · arms pinned to CPUs ' + _cpu_text(report['settings'].get('cpu_set')) if report['settings'].get('cpu_set') else ''}",
        "",
        f"| prompt | gen | batch | arm | prefill tok/s | TTFT s | decode tok/s | peak GB | GB/s | decode x {base} | prefill x {base} | status |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["rows"]:
        for arm, e in row["arms"].items():
            m, v = e["median"], e["vs_baseline"]
            bw = f"{e['bandwidth_gbps']:.3g}" if "bandwidth_gbps" in e else "-"
            lines.append(
                f"| {row['prompt_tokens']} | {row['generation_tokens']} | {row['batch_size']} | {arm} | {m['prefill_tps']:.1f} | "
                f"{m['ttft_s']:.3f} | {m['decode_tps']:.1f} | {m['peak_memory_gb']:.3g} | {bw} | {v['decode']:.2f} | "
                f"{v['prefill']:.2f} | {status_text(row)} |"
            )
    if report.get("stopped"):
        lines += ["", "Stopped by SIGTERM (a time limit) before the remaining rows of the matrix."]
    refused = [r for r in report["rows"] if r["status"] != "ok"]
    if refused:
        lines += ["", "Refused rows:"]
        for r in refused:
            lines += [f"- p={r['prompt_tokens']} g={r['generation_tokens']} b={r['batch_size']}: {why}" for why in r["reasons"]]
            lines += [f"- p={r['prompt_tokens']} g={r['generation_tokens']} b={r['batch_size']}: {arm}'s decode is "
                      f"{e['ratio_bounds']['decode'][0]:.2f}x to {e['ratio_bounds']['decode'][1]:.2f}x {base}'s, "
                      f"prefill {e['ratio_bounds']['prefill'][0]:.2f}x to {e['ratio_bounds']['prefill'][1]:.2f}x "
                      f"(every round's worst and best pairing)"
                      for arm, e in r["arms"].items() if arm != base and r["digests_agree"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    # A bare Figure renders off-screen without pyplot, so a caller's backend (a notebook's inline one) is untouched.
    from matplotlib.figure import Figure

    rows = [r for r in report["rows"] if r["status"] == "ok"]
    arms = list(report["settings"]["arms"])
    base = report["baseline"]
    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    color = {a: f"C{i}" for i, a in enumerate(arms)}  # one colour per arm, one line style per (g, b)
    series = sorted({(r["generation_tokens"], r["batch_size"]) for r in rows})
    styles = {gb: ("-", "--", ":", "-.")[i % 4] for i, gb in enumerate(series)}
    for ax, metric, title in ((axes[0], "decode_tps", "decode tok/s"), (axes[1], "prefill_tps", "prefill tok/s")):
        for arm in arms:
            for g, b in series:
                pts = sorted((r["prompt_tokens"], r["arms"][arm]["median"][metric]) for r in rows
                             if (r["generation_tokens"], r["batch_size"]) == (g, b))
                ax.plot(*zip(*pts), marker="o", color=color[arm], ls=styles[(g, b)], label=f"{arm} (g={g}, b={b})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (context)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    others = [a for a in arms if a != base]
    labels = [f"p{r['prompt_tokens']}\ng{r['generation_tokens']} b{r['batch_size']}" for r in rows]
    width = 0.8 / max(1, 2 * len(others))
    for i, arm in enumerate(others):
        for j, (kind, hatch) in enumerate((("decode", None), ("prefill", "//"))):
            xs = [k + (2 * i + j) * width for k in range(len(rows))]
            axes[2].bar(xs, [r["arms"][arm]["vs_baseline"][kind] for r in rows], width, hatch=hatch, color=color[arm],
                        edgecolor="white", label=f"{arm} {kind}")
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], labels, fontsize=7)
    axes[2].set_title(f"speedup vs {base}")
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=7)
    hw = report["hardware"]
    refused = len(report["rows"]) - len(rows)
    fig.suptitle(f"{report['model']['spec']} on {hw.get('gpu_name') or hw.get('cpu')}"
                 + (f" ({refused} refused rows omitted)" if refused else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_kernels(argv: list[str]) -> int:
    try:
        kernels = importlib.import_module(f"{__package__}.kernels")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.kernels":
            raise
        print("error: --kernels needs bench/kernels.py (the kernel microbenchmarks), which this install does not have",
              file=sys.stderr)
        return 2
    return kernels.main(argv) or 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--digest"]:
        print(source_digest(Path(__file__).resolve().parents[1]))
        return 0
    if "--kernels" in argv:
        argv.remove("--kernels")
        return run_kernels(argv)
    args = parser().parse_args(argv)
    try:
        for flag, values, low in (("-p", args.prompt_tokens, 1), ("-g", args.generation_tokens, 2), ("-b", args.batch_size, 1)):
            if any(v < low for v in values):
                raise BenchError(f"{flag} values must be >= {low}, got {values}")
        if args.num_trials < 2:
            raise BenchError(f"-n {args.num_trials}: the drift check needs at least 2 rounds")
        arms = expand_arms(args.arms)
        args.cpu_set = resolve_cpus(args.cpus)
        model, manifest = resolve_model(args)
        from .traffic import DecodeTraffic

        traffic = DecodeTraffic(model)
        started = time.time()
        previous = signal.signal(signal.SIGTERM, _raise_stopped)  # a time limit's SIGTERM keeps the rows so far
        try:
            rows, infos, stopped = run_matrix(args, arms, model, traffic)
        finally:
            if signal.getsignal(signal.SIGTERM) is _raise_stopped:  # once stopped, later SIGTERMs stay ignored
                signal.signal(signal.SIGTERM, previous)
    except (BenchError, arm_mod.ArmError, random_model.SpecError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((model / "config.json").read_text())
    report = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ok": all(r["status"] == "ok" for r in rows) and not stopped,
        "stopped": stopped,
        "hardware": hardware(infos),
        "versions": versions(),
        "git": git_info(),
        "settings": {**vars(args), "arms": arms, "argv": argv, "arm_env": {a: arm_mod.arm_env(a) for a in arms},
                     "perturbation": os.environ.get(arm_mod.PERTURB_ENV) or None, "wall_s": time.time() - started},
        "model": {"spec": args.model, "path": str(model), "random": manifest,
                  "text_config": {k: v for k, v in cfg.get("text_config", cfg).items() if k != "layer_types"},
                  "quantization": {k: v for k, v in (cfg.get("quantization") or {}).items() if not isinstance(v, dict)},
                  "traffic": traffic.summary()},
        "baseline": "stock" if "stock" in arms else arms[0],
        "arms": infos,
        "rows": rows,
    }
    table = markdown(report)
    print(table)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.plot:
        plot(report, args.plot)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
