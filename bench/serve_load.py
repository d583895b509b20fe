"""Bounded load generator for `lily-mlx serve`: requests/s and aggregate decode tok/s at several concurrencies.

Talks to 127.0.0.1 only. Either starts the server itself (--model PATH, or --tiny for the test suite's tiny
checkpoint) or uses one already running (--url http://127.0.0.1:PORT). Per concurrency C: a warm-up of C
requests, then --requests-per-client x C streamed /v1/completions requests (greedy, distinct prompts, EOS
barred with logit_bias so every request generates exactly --max-tokens), C at a time.

--arms lily,stock serves the same load from stock mlx-lm's server (`python -m mlx_lm server`, its batching
generator at --decode-concurrency of the largest level) too, a fresh process per arm and round, the arms
alternating for --rounds rounds; the table then gives each arm's median and lily's ratio to stock. Arm
`baseline` is lily's server from another tree (--baseline DIR, e.g. `git archive REV lily_mlx kernels | tar -x -C
DIR`), run from inside it so that its own lily_mlx is the one imported; the table gives lily's ratio to it too.
Arms `lily-with-NAME[+NAME...]` and `lily-no-NAME[+NAME...]` (bench.ab's names) are this tree's server with those
switches opted into or turned off, on top of this process's own, e.g. `--arms lily,lily-with-batched_prefill` for a
switch's A/B on one machine; the table gives their ratio to plain lily.

Each level's row keeps its warm-up requests' wall time and TTFT too (`warm_up`): after a cold start, the first
requests' wait. A request that receives nothing for --stall-timeout seconds counts as an error and ends its level (a stalled server
must not hang the bench), and a started server is killed when this process dies (Linux: PR_SET_PDEATHSIG).

    python -m bench.serve_load --tiny --concurrency 1,8,32
    python -m bench.serve_load --model PATH --max-tokens 128 --json results.json
    python -m bench.serve_load --model PATH --arms lily,stock --rounds 2 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import httpx

from .arm import NO_PREFIX, WITH_PREFIX, ArmError, parse_arm

REPO = Path(__file__).resolve().parents[1]
MAX_TOTAL_REQUESTS = 20000
WORDS = "the quick brown fox jumps over a lazy dog while models serve many small requests today".split()


def _prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))


class Stalled(Exception):
    pass


def _one(client: httpx.Client, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, usage, reason = None, None, None
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        try:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(f"error event: {ev['error']}")
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    if ttft is None and ch.get("text"):
                        ttft = time.perf_counter() - t0
                    reason = ch.get("finish_reason") or reason
        except httpx.ReadTimeout as e:
            raise Stalled(f"nothing received for {client.timeout.read} s, {time.perf_counter() - t0:.1f} s into "
                          "the request") from e
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": usage["completion_tokens"], "finish": reason}


def run_level(url: str, concurrency: int, n_requests: int, max_tokens: int, prompt_words: int, bar: list[int], offset: int,
              stall_timeout: float = 120) -> dict:
    results, errors = [], []
    lock = threading.Lock()
    next_i = [0]
    stalled = threading.Event()

    def worker():
        with httpx.Client(base_url=url, timeout=httpx.Timeout(stall_timeout, connect=10)) as c:
            while True:
                with lock:
                    i = next_i[0]
                    if i >= n_requests or stalled.is_set():
                        return
                    next_i[0] += 1
                body = {"prompt": _prompt(offset + i, prompt_words), "max_tokens": max_tokens, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {str(t): -100 for t in bar}}
                try:
                    res = _one(c, body)
                    with lock:
                        results.append(res)
                except Exception as e:  # noqa: BLE001 (counted and reported)
                    if isinstance(e, Stalled):
                        stalled.set()
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    per_seq = [r["tokens"] / (r["latency"] - r["ttft"]) for r in results if r["ttft"] is not None and r["latency"] > r["ttft"]]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": n_requests - len(results),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3), "decode_tok_per_s": round(tokens / wall, 1),
        "completion_tokens": tokens, "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "latency_p50_s": round(statistics.median(r["latency"] for r in results), 4) if results else None,
        "per_sequence_tok_per_s_p50": round(statistics.median(per_seq), 1) if per_seq else None,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVERS = ("lily", "stock", "baseline")


def _switches(arm: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(switches turned off, switches opted into) of a lily-no-* / lily-with-* arm (bench.arm's names); none else."""
    return parse_arm(arm)[2:] if arm.startswith((NO_PREFIX, WITH_PREFIX)) else ((), ())


def _die_with_parent() -> None:
    # A bench killed at its time limit must not leave its server holding the GPU and the log's pipe.
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start_server(arm: str, model: str, max_batch: int, extra: list[str], baseline: Optional[Path] = None,
                  ready_timeout: float = 600) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    root = baseline if arm == "baseline" else REPO  # `python -m` imports from its working directory first
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for var, names in zip(("LILY_MLX_DISABLE", "LILY_MLX_ENABLE"), _switches(arm)):
        if names:
            env[var] = ",".join(filter(None, [os.environ.get(var, ""), *names]))
    if arm == "stock":
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port), "--decode-concurrency",
               str(max_batch), "--log-level", "WARNING"]
    else:
        cmd = [sys.executable, "-m", "lily_mlx.server", "--model", model, "--port", str(port), "--max-batch",
               str(max_batch), "--max-queue", str(max(64, max_batch)), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=root, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{arm} server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{arm} server not ready after {ready_timeout:g} s (--ready-timeout)")


def _eos_ids(model_dir: Path) -> list[int]:
    from mlx_lm.utils import load_tokenizer

    from lily_mlx.loading import _eos_ids, resolve_model_path

    path = resolve_model_path(str(model_dir))
    cfg = json.loads((path / "config.json").read_text())
    return sorted(load_tokenizer(path, eos_token_ids=_eos_ids(cfg)).eos_token_ids)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="serve this model folder / repo (started here on 127.0.0.1)")
    src.add_argument("--tiny", action="store_true", help="serve the test suite's tiny random checkpoint")
    src.add_argument("--url", help="an already running server on 127.0.0.1 (EOS is not barred unless --bar-token)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--bar-token", type=int, action="append", default=None, help="token ids barred with logit_bias -100 (default: EOS)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started lily server (repeatable)")
    p.add_argument("--arms", default="lily", help="comma-separated servers to start: lily, stock, baseline, "
                   f"{WITH_PREFIX}SWITCH[+SWITCH...], {NO_PREFIX}SWITCH[+SWITCH...] (default lily)")
    p.add_argument("--baseline", type=Path, help="the tree arm `baseline` serves from (a folder holding a lily_mlx package)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every arm, alternating (default 1)")
    p.add_argument("--stall-timeout", type=float, default=120,
                   help="seconds a request may receive nothing before it counts as an error and ends its level (default 120)")
    p.add_argument("--ready-timeout", type=float, default=600,
                   help="seconds a started server may take to answer /health (a machine with empty kernel caches builds "
                        "them first; default 600)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    levels = [int(x) for x in args.concurrency.split(",")]
    if any(not 1 <= c <= 256 for c in levels) or args.requests_per_client < 1:
        p.error("concurrency must be in 1..256 and --requests-per-client >= 1")
    arms = args.arms.split(",")
    switched = [a for a in arms if a not in SERVERS]
    if not arms or len(set(arms)) != len(arms) or any(not a.startswith((NO_PREFIX, WITH_PREFIX)) for a in switched):
        p.error(f"--arms takes distinct names of {', '.join(SERVERS)}, {WITH_PREFIX}SWITCH[+SWITCH...] or "
                f"{NO_PREFIX}SWITCH[+SWITCH...], got {args.arms!r}")
    try:
        named = {n for a in switched for side in _switches(a) for n in side}
    except ArmError as e:
        p.error(f"--arms: {e}")
    if named:
        from lily_mlx import ops
        from lily_mlx.server import engine  # noqa: F401 (registers the server's switches)

        unknown = sorted(named - set(ops.KERNEL_NAMES))
        if unknown:
            p.error(f"--arms: unknown switch {', '.join(unknown)}; known: {', '.join(sorted(ops.KERNEL_NAMES))}")
    if ("baseline" in arms) != (args.baseline is not None):
        p.error("arm baseline and --baseline DIR go together")
    if args.baseline is not None and not (args.baseline / "lily_mlx" / "server" / "__main__.py").is_file():
        p.error(f"--baseline {args.baseline}: no lily_mlx server package in it")
    if not 1 <= args.rounds <= 20:
        p.error(f"--rounds must be in 1..20, got {args.rounds}")
    if args.stall_timeout <= 0:
        p.error(f"--stall-timeout must be > 0, got {args.stall_timeout}")
    if args.url and (arms != ["lily"] or args.rounds != 1):
        p.error("--arms and --rounds start servers; --url measures one that runs already")
    total = sum(c * (args.requests_per_client + 1) for c in levels) * len(arms) * args.rounds
    if total > MAX_TOTAL_REQUESTS:
        p.error(f"{total} requests planned; the limit is {MAX_TOTAL_REQUESTS}")

    tmp = None
    runs: list[dict] = []  # {"arm", "round", "levels"} in the order they ran

    def write():  # after every level, so a run cut short keeps the levels it finished
        if args.json:
            Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                                                   "levels": runs[0]["levels"], "runs": runs,
                                                   "summary": _summary(runs, levels)}, indent=2))

    try:
        if args.url:
            host = urlparse(args.url).hostname
            if host not in ("127.0.0.1", "localhost", "::1"):
                p.error(f"--url must point at this machine (127.0.0.1), got host {host!r}")
            runs.append({"arm": "url", "round": 0, "levels": []})
            _run_levels(args.url.rstrip("/"), levels, args, args.bar_token or [], runs[-1], write)
        else:
            if args.tiny:
                sys.path.insert(0, str(REPO / "tests"))
                from test_server_fixtures import build_tiny_checkpoint

                tmp = tempfile.TemporaryDirectory()
                model = str(build_tiny_checkpoint(Path(tmp.name) / "tiny"))
            else:
                model = args.model
            bar = args.bar_token if args.bar_token is not None else _eos_ids(Path(model))
            for r in range(args.rounds):
                for arm in arms:
                    t0 = time.monotonic()
                    proc, url = _start_server(arm, model, max(levels), args.server_arg,
                                              args.baseline and args.baseline.resolve(), args.ready_timeout)
                    try:
                        ready = time.monotonic() - t0
                        print(f"{arm} server ready in {ready:.1f} s (load and kernel warm-up)", flush=True)
                        runs.append({"arm": arm, "round": r, "ready_s": ready, "levels": []})
                        _run_levels(url, levels, args, bar, runs[-1], write)
                    finally:
                        _stop(proc)
        _print_table(runs, levels)
        return 0 if all(row["errors"] == 0 for run in runs for row in run["levels"]) else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run_levels(url: str, levels: list[int], args, bar: list[int], run: dict, write) -> None:
    offset = 0
    for c in levels:
        warm = run_level(url, c, c, args.max_tokens, args.prompt_words, bar, offset, args.stall_timeout)
        offset += c
        row = run_level(url, c, c * args.requests_per_client, args.max_tokens, args.prompt_words, bar, offset,
                        args.stall_timeout)
        row["warm_up"] = {k: warm[k] for k in ("errors", "wall_s", "ttft_p50_s")}  # a cold start's first requests
        offset += c * args.requests_per_client
        run["levels"].append(row)
        print(json.dumps({"arm": run["arm"], **row}), flush=True)
        write()


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _summary(runs: list[dict], levels: list[int]) -> list[dict]:
    """Per level and arm: the median over rounds of the aggregate and per-sequence tok/s and TTFT, the aggregate's
    spread ((max - min) / median), lily's aggregate over stock's and over the baseline's where they ran, and each
    lily-with-* / lily-no-* arm's over lily's."""
    out = []
    for c in levels:
        by_arm: dict[str, list[dict]] = {}
        for run in runs:
            by_arm.setdefault(run["arm"], []).extend(row for row in run["levels"] if row["concurrency"] == c)
        level, medians = {}, {}
        for arm, rows in by_arm.items():
            if not rows:
                continue
            agg = [row["decode_tok_per_s"] for row in rows]
            med = medians[arm] = statistics.median(agg)
            pick = lambda k, digits: round(statistics.median(v for row in rows if (v := row[k]) is not None), digits) \
                if any(row[k] is not None for row in rows) else None  # noqa: E731
            level[arm] = {"concurrency": c, "arm": arm, "rounds": len(rows), "decode_tok_per_s": round(med, 1),
                          "spread": round((max(agg) - min(agg)) / med, 3) if med else None,
                          "per_sequence_tok_per_s_p50": pick("per_sequence_tok_per_s_p50", 1),
                          "ttft_p50_s": pick("ttft_p50_s", 4), "errors": sum(row["errors"] for row in rows)}
        for other in ("stock", "baseline"):
            if "lily" in level and medians.get(other):
                level["lily"][f"x_{other}"] = round(medians["lily"] / medians[other], 2)
        for arm in level:
            if arm not in SERVERS and medians.get("lily"):
                level[arm]["x_lily"] = round(medians[arm] / medians["lily"], 2)
        out += level.values()
    return out


def _print_table(runs: list[dict], levels: list[int]) -> None:
    print("\n| clients | server | rounds | decode tok/s (aggregate, median) | spread | x stock | x baseline | x lily "
          "| per-sequence tok/s (p50) | TTFT p50 (s) | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in _summary(runs, levels):
        print(f"| {r['concurrency']} | {r['arm']} | {r['rounds']} | {r['decode_tok_per_s']} | {r['spread']} "
              f"| {r.get('x_stock', '')} | {r.get('x_baseline', '')} | {r.get('x_lily', '')} | {r['per_sequence_tok_per_s_p50']} "
              f"| {r['ttft_p50_s']} | {r['errors']} |")


if __name__ == "__main__":
    sys.exit(main())
