"""`lily-mlx serve` and `python -m lily_mlx.server`: parse flags, start uvicorn, load the model in the engine thread.

Exit status: 0 after a clean shutdown (SIGTERM/SIGINT drain included), 1 if the model failed to load
or the engine loop died, 3 if the server could not start (e.g. the port is taken).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import Optional

log = logging.getLogger("lily_mlx.server")


def _size(text: str) -> int:
    """Bytes from '4096', '512K', '64M', '2G'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K/M/G)") from None


def _positive(kind):
    def parse(text):
        v = kind(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return v
    return parse


def _count(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return v


def build_parser(prog: str = "lily-mlx serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for lily_mlx models.")
    p.add_argument("--model", default="embedded", help="model folder, hub repo id (owner/name), 'embedded' (default, bf16) or 'embedded-4bit'")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists (default: from --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("LILY_MLX_API_KEY"), help="require 'Authorization: Bearer KEY' (env LILY_MLX_API_KEY)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting to start before 429 (default 64)")
    p.add_argument("--max-batch", type=_positive(int), default=32, help="sequences decoded together (default 32)")
    p.add_argument("--max-body-bytes", type=_size, default=4 << 20, help="request body limit, 413 above (default 4M)")
    p.add_argument("--max-tokens-limit", type=_positive(int), default=8192, help="largest max_tokens accepted (default 8192)")
    p.add_argument("--max-context", type=_positive(int), help="prompt + completion token limit (default: the model's)")
    p.add_argument("--request-timeout", type=_positive(float), default=600.0, help="seconds a request may run (default 600)")
    p.add_argument("--read-timeout", type=_positive(float), default=30.0, help="seconds to receive a request body (default 30)")
    p.add_argument("--drain-timeout", type=_positive(float), default=30.0, help="seconds SIGTERM waits for open requests (default 30)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip building the decode and prefill kernels before /health says ready")
    p.add_argument("--warm-up-workers", type=_count, default=0,
                   help="processes that run the warm-up's pieces side by side while the model loads, each holding "
                        "its first layers (logged; ~3 GB of the 35B-A3B by its tensor sizes) beside the server's "
                        "model: a machine with empty kernel caches starts sooner (default 0: none)")
    p.add_argument("--warm-up-only", action="store_true",
                   help="load the model, build every kernel the warm-up builds, then exit without serving: run once "
                        "on a new machine or image, later starts find the builds on disk")
    p.add_argument("--prefill-step", type=_positive(int), default=512, help="prompt tokens per prefill chunk (default 512)")
    p.add_argument("--prefix-cache-bytes", type=_size, default=2 << 30, help="prefix cache size, 0 disables (default 2G)")
    p.add_argument("--chat-template-args", type=json.loads, default={}, help='JSON for apply_chat_template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _model_path(args: argparse.Namespace) -> Optional[str]:
    """The checkpoint folder warm-up workers load, where there are workers; None if --model does not resolve (the
    server's own load then says why)."""
    if not args.warm_up_workers:
        return None
    from ..loading import resolve_model_path

    try:
        return str(resolve_model_path(args.model))
    except Exception:  # noqa: BLE001 - reported by the load itself
        return None


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .. import load
    from .app import Server, ServerConfig, create_app
    from .engine import Engine
    from .metrics import Metrics
    from .prefix_cache import PrefixCache

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not isinstance(args.chat_template_args, dict):
        log.error("--chat-template-args must be a JSON object")
        return 2
    if not args.warmup and (args.warm_up_only or args.warm_up_workers):
        log.error("--%s and --no-warmup contradict each other", "warm-up-only" if args.warm_up_only else "warm-up-workers")
        return 2
    cfg = ServerConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port, api_key=args.api_key,
        max_queue=args.max_queue, max_batch=args.max_batch, max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit, max_context=args.max_context, request_timeout=args.request_timeout,
        read_timeout=args.read_timeout, drain_timeout=args.drain_timeout, prefill_step=args.prefill_step,
        prefix_cache_bytes=args.prefix_cache_bytes, chat_template_args=args.chat_template_args, warmup=args.warmup,
    )
    metrics = Metrics()
    exit_code = {"code": 0}
    holder: dict = {}

    def on_death(exc: BaseException) -> None:
        exit_code["code"] = 1
        server = holder.get("uvicorn")
        loop = holder.get("loop")
        if server is not None and loop is not None:
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        elif server is not None:  # died while loading, before the event loop started: startup returns at once
            server.should_exit = True
        # If the event loop cannot shut down on its own, do not linger as a server that cannot serve.
        backstop = threading.Timer(cfg.drain_timeout + 10, os._exit, (1,))
        backstop.daemon = True
        backstop.start()

    engine = Engine(lambda: load(cfg.model), max_batch=cfg.max_batch, max_queue=cfg.max_queue, prefill_step=cfg.prefill_step,
                    prefix_cache=PrefixCache(cfg.prefix_cache_bytes), metrics=metrics, on_death=on_death,
                    warmup=cfg.warmup, warm_up_workers=args.warm_up_workers, model_path=_model_path(args))
    if args.warm_up_only:
        engine.start()
        while not engine.ready.wait(0.5) and engine.alive:
            pass
        engine.stop()
        # MLX's threads, started from the engine's, abort a normal interpreter exit ("terminate called without an
        # active exception"): leave as the serving path does when the engine outlives it.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0 if engine.ready.is_set() and engine.dead is None else 1)
    state = Server(cfg, engine, metrics)
    app = create_app(state)

    class DrainingServer(uvicorn.Server):
        """First SIGTERM/SIGINT: answer 503, let open requests finish (up to --drain-timeout), then shut down.
        A second signal exits at once."""

        def handle_exit(self, sig, frame):
            if state.draining:
                self.force_exit = self.should_exit = True
                return
            state.draining = True
            engine.drain()
            loop = holder.get("loop")
            if loop is None:  # signalled before the server started: nothing to drain
                self.should_exit = True
                return
            loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self):
            self._drain_task = asyncio.ensure_future(self._drain())  # held, so the task is not garbage-collected

        async def _drain(self):
            log.info("draining: waiting up to %.0f s for open requests", cfg.drain_timeout)
            deadline = time.monotonic() + cfg.drain_timeout
            while engine.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if engine.busy:
                log.warning("drain deadline passed; ending the remaining requests with an error")
            engine.stop()  # answers anything left with 503 so streams still end with [DONE]
            await asyncio.sleep(0.2)  # let the handlers send their last events
            self.should_exit = True

        async def startup(self, sockets=None):
            holder["loop"] = asyncio.get_running_loop()
            await super().startup(sockets)

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=args.log_level, lifespan="off",
                            timeout_graceful_shutdown=5, access_log=args.log_level == "debug")
    server = DrainingServer(config)
    holder["uvicorn"] = server
    engine.start()
    server.run()
    engine.stop()
    code = exit_code["code"] if server.started else 3
    if engine.alive:
        # Still loading (not interruptible): a daemon thread inside MLX at interpreter exit would abort the process.
        logging.shutdown()
        os._exit(code)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    return serve(build_parser().parse_args(argv))


