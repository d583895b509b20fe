"""The server's warm-up: every kernel the first requests would build, built before /health says ready.

On a machine whose kernel caches are empty, MLX compiles each kernel with NVRTC in the process that first launches
it, one at a time: a cold H100 took 281 s (run 92), 207 s of it the prefills of 16, 32 and 64 tokens, which built
11 of MLX's own kernels and 7 of ours (the 32-token one 61 s for 3 of MLX's). The pieces are independent, so with `--warm-up-workers N` N processes, each holding the first
few decoder layers of the same checkpoint, run them side by side while the server loads; each kernel they build lands
in the caches on disk (MLX's own, and ours through kernel_cache), and the server's own pass then finds them there.

    python -m lily_mlx.server.warm_up --model PATH --piece "prefill of 16 tokens" [--piece ...]   (one worker)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from .. import ops
from ..decode import CompiledDecoder, SlotBatchDecoder
from ..memory import bounded_prefill
from ..ops import DECODE_KERNEL_ROWS, kernel_cache
from ..ops.kernels import row_bucket

log = logging.getLogger("lily_mlx.server")
# Seconds the server waits for its warm-up workers before it builds what they have not.
WORKERS_TIMEOUT = 1800.0


@contextlib.contextmanager
def timed(what: str):
    """Logs one piece of the warm-up: its time, and on CUDA the kernels it built (ours through kernel_cache, MLX's own
    as new files in its cache), so a cold machine's start says where its minutes go. In a worker MLX's count also holds
    what the other workers wrote meanwhile."""
    cuda = ops.backend() == "cuda"
    count = lambda: sum(1 for _ in kernel_cache.cache_dir().rglob("*.ptx")) if cuda else 0  # noqa: E731
    before, ours, t0 = count(), kernel_cache.stats["built"], time.monotonic()
    yield
    built = kernel_cache.stats["built"] - ours
    log.info("warm-up: %s in %.2f s%s", what, time.monotonic() - t0,
             f" ({built} of our kernels built, {count() - before - built} of MLX's)" if cuda else "")


def decode_rows(max_batch: int) -> list[int]:
    """One batch of each kernel row bucket up to max_batch (past DECODE_KERNEL_ROWS no kernel applies)."""
    top = min(max_batch, DECODE_KERNEL_ROWS)
    return sorted({min(row_bucket(n), top) for n in range(1, top + 1)})


def prefill_lengths(prefill_step: int) -> list[int]:
    """2, 4, 8, ... up to prefill_step: the prefill's kernels and their tiles are picked by rows."""
    return sorted({min(2 ** i, prefill_step) for i in range(1, prefill_step.bit_length() + 1)})


def pieces(engine) -> list[tuple[str, Callable[[], None]]]:
    """(label, run) of each piece of `engine`'s warm-up, in order: the decode step of every row bucket as the loop runs
    it (compiled alone or in slots, at a short prompt's capacity) with its logprobs, then the prefills, with
    batched_prefill also two prompts prefilled together (one of them padded). The labels need no model loaded."""

    def decode(b: int) -> None:
        from .engine import _as_batch

        model = engine.model
        cache = model.make_cache()
        model(mx.zeros((1, 1), mx.int32), cache=cache)
        if b == 1 and CompiledDecoder.applicable(model, cache):
            logits = CompiledDecoder(model, cache, reserve=2)(mx.zeros((1, 1), mx.int32))
        elif b > 1 and SlotBatchDecoder.applicable(model, cache):
            slots = SlotBatchDecoder(model, cache, row_bucket(b))
            slots.join(cache)
            logits = slots(mx.zeros((slots.slots, 1), mx.int32))
        else:
            logits = model(mx.zeros((b, 1), mx.int32), cache=_as_batch(cache, b))[:, -1, :]
        mx.eval(ops.to_logprobs(logits.astype(mx.float32), greedy=True))

    def prefill(n: int) -> None:
        with bounded_prefill():
            cache = engine.model.make_cache()
            engine.model(mx.zeros((1, n), mx.int32), cache=cache)
            mx.eval([c.state for c in cache])

    def prefill_two(n: int) -> None:
        with bounded_prefill():
            mx.eval([c.state for c in engine._prefill_rows([[0] * n, [0] * (n - 1)])])

    out = [(f"decode step of {b} row{'s' * (b > 1)}", lambda b=b: decode(b)) for b in decode_rows(engine.max_batch)]
    grouped = ops.enabled("batched_prefill") and engine.max_batch > 1
    for n in prefill_lengths(engine.prefill_step):
        out.append((f"prefill of {n} tokens", lambda n=n: prefill(n)))
        if grouped and 2 * n <= engine.prefill_step:
            out.append((f"prefill of 2 x {n} tokens together", lambda n=n: prefill_two(n)))
    return out


def layers_to_hold(model_path: str) -> int:
    """The first decoder layers a worker holds: up to the first of each kind (3 DeltaNet layers and an attention layer
    at the 3:1 layout). A kernel's build depends on a layer's widths, not on how many layers there are."""
    from ..config import ModelConfig, read_config_json

    raw, where = read_config_json(Path(model_path))
    kinds = ModelConfig.from_dict(raw, where=str(where)).layer_types
    return max(kinds.index(k) for k in set(kinds)) + 1


def start_workers(model_path: str, labels: list[str], workers: int, max_batch: int,
                  prefill_step: int) -> list[subprocess.Popen]:
    """`workers` processes (at most one a piece), piece i going to worker i mod workers; they inherit this process's
    environment (switches, plans, cache folders) and log to its stderr."""
    workers = min(workers, len(labels))
    procs = []
    for w in range(workers):
        cmd = [sys.executable, "-m", "lily_mlx.server.warm_up", "--model", model_path, "--max-batch", str(max_batch),
               "--prefill-step", str(prefill_step), "--parent", str(os.getpid())]
        for label in labels[w::workers]:
            cmd += ["--piece", label]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    log.info("warm-up: %d pieces in %d worker processes", len(labels), workers)
    return procs


def wait_workers(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits for the workers; one that fails or runs past `timeout` is stopped and only logged: what it did not build,
    the server's own pass builds."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            code = p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            code = p.wait()
            log.warning("warm-up worker %d ran past %.0f s and was stopped", p.pid, timeout)
            continue
        if code:
            log.warning("warm-up worker %d exited with %d; the server builds its pieces itself", p.pid, code)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily_mlx.server.warm_up", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (the server's, resolved)")
    ap.add_argument("--piece", action="append", required=True, help="a piece's label, as the server logs it")
    ap.add_argument("--max-batch", type=int, required=True)
    ap.add_argument("--prefill-step", type=int, required=True)
    ap.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if sys.platform == "linux" and args.parent:  # a server killed outright takes its workers with it
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != args.parent:  # it died before the line above
            return 1
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s %(name)s (worker {os.getpid()}): %(message)s")
    from ..loading import load_model
    from .engine import Engine

    engine = Engine(lambda: None, max_batch=args.max_batch, prefill_step=args.prefill_step)
    try:
        layers = layers_to_hold(args.model)
        engine.model, _ = load_model(args.model, layers=layers, progress=False)
    except (OSError, ValueError) as e:  # CheckpointError and ConfigError are ValueErrors
        log.error("cannot load %s: %s", args.model, e)
        return 1
    # Each worker holds this beside the server's whole model: what sizes N on a small GPU.
    log.info("warm-up worker holds %d layers, %.1f GB", layers, mx.get_active_memory() / 1e9)
    known = dict(pieces(engine))
    unknown = [label for label in args.piece if label not in known]
    if unknown:
        ap.error(f"no warm-up piece {unknown[0]!r} at --max-batch {args.max_batch} --prefill-step {args.prefill_step}")
    for label in args.piece:
        with timed(label):
            known[label]()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)  # as the server's --warm-up-only: MLX's threads abort a normal interpreter exit


if __name__ == "__main__":
    sys.exit(main())
