"""The ASGI app (Starlette on uvicorn): OpenAI-style endpoints in front of the one engine loop.

Per request: availability (503 while loading / draining), bearer auth (401), a body read with a size
limit (413) and a read deadline, JSON + schema validation (400), the model label (404), prompt
building on one tokenizer thread, context limits (400 context_length_exceeded), then admission to
the engine (429 when the queue is full). Streams are SSE ending in `data: [DONE]`; an error after
the headers goes out as an error event first. A client that disconnects cancels its work.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .engine import Engine, Request, Unavailable
from .metrics import Metrics
from .output import ChoiceOutput, Delta, TokenLogprob
from .schema import APIError, BadRequest, ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json

log = logging.getLogger("lily_mlx.server")


class Unauthorized(APIError):
    status, type = 401, "invalid_request_error"


class NotFound(APIError):
    status, type = 404, "invalid_request_error"


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"


@dataclass
class ServerConfig:
    model: str
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    max_queue: int = 64
    max_batch: int = 32
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 8192
    max_context: Optional[int] = None  # None: the model's max_position_embeddings
    request_timeout: float = 600.0
    read_timeout: float = 30.0
    drain_timeout: float = 30.0
    prefill_step: int = 512
    warmup: bool = True  # build the decode kernels for every batch size before ready
    prefix_cache_bytes: int = 2 << 30
    chat_template_args: dict = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").rsplit("/", 1)[-1] if self.model.startswith((".", "/", "~")) else self.model

    @property
    def labels(self) -> set[str]:
        return {self.model_id, self.model}


def error_response(e: APIError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Server:
    """State shared by the handlers: config, engine, metrics, the tokenizer thread, the drain flag."""

    def __init__(self, cfg: ServerConfig, engine: Engine, metrics: Metrics):
        self.cfg, self.engine, self.metrics = cfg, engine, metrics
        self.draining = False
        self._mailbox: Optional[Mailbox] = None
        # One thread: HF tokenizers and Jinja templates stay off the event loop, and are never used concurrently.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lily-tokenize")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> "Mailbox":
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return self._mailbox

    def check_available(self) -> None:
        if self.engine.dead is not None:
            raise Unavailable("the engine has stopped after an internal error", code="engine_dead")
        if self.draining:
            raise Unavailable("the server is shutting down and accepts no new requests", code="draining")
        if not self.engine.ready.is_set():
            raise Unavailable("the model is still loading; retry shortly", code="loading")

    def check_auth(self, request: HTTPRequest) -> None:
        key = self.cfg.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            what = "no Authorization header" if not got else "an incorrect API key"
            raise Unauthorized(f"this server requires 'Authorization: Bearer <key>'; the request has {what}", code="invalid_api_key")

    def check_model(self, label: Optional[str]) -> None:
        if label is not None and label not in self.cfg.labels:
            raise NotFound(f"the model '{label}' does not exist on this server; it serves '{self.cfg.model_id}'", param="model", code="model_not_found")

    @property
    def max_context(self) -> int:
        if self.cfg.max_context:
            return self.cfg.max_context
        cfg = getattr(self.engine.model, "config", None)
        return getattr(cfg, "max_position_embeddings", None) or 1 << 30

    async def read_body(self, request: HTTPRequest) -> bytes:
        limit, timeout = self.cfg.max_body_bytes, self.cfg.read_timeout
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise BadRequest(f"the Content-Length header {declared!r} is not a byte count")
            if int(declared) > limit:
                raise PayloadTooLarge(f"the request body of {declared} bytes is over this server's limit of {limit} bytes (--max-body-bytes)")
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        deadline = time.monotonic() + timeout
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                expected = f" of the {declared} declared" if declared is not None else ""
                raise BadRequest(
                    f"the request body was not received in time: {size} bytes{expected} within {timeout:g} s (--read-timeout)",
                    code="body_read_timeout",
                ) from None
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], list[int], str]:
        """-> (prompt tokens, snapshot positions at message boundaries, initial output state)."""
        tok = self.tokenizer
        kwargs = {**self.cfg.chat_template_args, **req.template_kwargs}

        def render(messages, add_generation_prompt):
            return list(tok.apply_chat_template(messages, tools=req.tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs))

        try:
            prompt = render(req.messages, True)
        except Exception as e:  # the template itself refused these messages (jinja raise, missing fields)
            raise BadRequest(f"the chat template could not render these messages: {type(e).__name__}: {e}", param="messages") from None
        if not prompt:
            raise BadRequest("the chat template rendered an empty prompt", param="messages")
        n = len(req.messages)
        # Where earlier turns end: the next turn of this chat resumes from one of these.
        snaps = {len(prompt) - 1}
        for k in {1, n - 2, n - 1, n} - {0, -1}:
            try:
                part = render(req.messages[:k], False)
            except Exception:
                continue  # templates may refuse partial conversations; that boundary is just not cached
            m = min(len(part), len(prompt))
            differ = np.flatnonzero(np.asarray(part[:m]) != np.asarray(prompt[:m]))
            common = int(differ[0]) if differ.size else m  # the longest common prefix
            if 0 < common < len(prompt):
                snaps.add(common)
        state = "normal"
        if tok.has_thinking and tok.rfind_think_start(prompt) > tok.rfind_think_end(prompt):
            state = "reasoning"
        return prompt, sorted(snaps), state

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        if isinstance(req.prompts[0], str):
            return [list(self.tokenizer.encode(p)) or _empty(i) for i, p in enumerate(req.prompts)]
        return [list(p) for p in req.prompts]

    def max_new(self, prompt_len: int, requested: Optional[int], prompt_param: str) -> int:
        ctx, limit = self.max_context, self.cfg.max_tokens_limit
        if prompt_len >= ctx:
            raise BadRequest(
                f"this model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens; shorten the prompt",
                param=prompt_param, code="context_length_exceeded",
            )
        if requested is not None:
            if requested > limit:
                raise BadRequest(f"max_tokens {requested} is over this server's limit of {limit} (--max-tokens-limit)", param="max_tokens")
            if prompt_len + requested > ctx:
                raise BadRequest(
                    f"this model's maximum context length is {ctx} tokens, but {prompt_len + requested} were requested "
                    f"({prompt_len} in the prompt, {requested} for the completion); lower max_tokens or shorten the prompt",
                    param="max_tokens", code="context_length_exceeded",
                )
            return requested
        return min(limit, ctx - prompt_len)


def _empty(i: int):
    raise BadRequest(f"'prompt[{i}]' tokenizes to no tokens", param="prompt")


class Collector:
    """Turns engine events into the response: per-choice text, tool calls, logprobs, usage."""

    def __init__(self, server: Server, kind: str, req_id: str, n_choices: int, prompt_lens: list[int]):
        self.server, self.kind, self.n = server, kind, n_choices
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + req_id
        self.created = int(time.time())
        self.prompt_lens = prompt_lens
        self.cached = [0] * len(prompt_lens)
        self.finish: list[Optional[str]] = [None] * n_choices
        self.tokens = [0] * n_choices
        self.deltas = [Delta() for _ in range(n_choices)]
        self.tool_index = [0] * n_choices
        self.text_offset = [0] * n_choices
        self.error: Optional[APIError] = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(f is not None for f in self.finish)

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_lens), sum(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}

    def apply(self, event: tuple) -> list[tuple[int, Delta, Optional[str]]]:
        """Record one engine event; -> the (choice, delta, finish_reason) updates it makes."""
        kind = event[0]
        if kind == "prompt":
            self.cached[event[1]] = event[2]
        elif kind == "error":
            self.error = event[1]
        elif kind == "delta":
            self.deltas[event[1]].extend(event[2])
            return [(event[1], event[2], None)]
        elif kind == "finish":
            _, c, reason, delta, ntok = event
            self.deltas[c].extend(delta)
            self.finish[c], self.tokens[c] = reason, ntok
            return [(c, delta, reason)]
        return []

    def _logprobs(self, choice: int, entries: list[TokenLogprob]) -> dict:
        tok = self.server.tokenizer
        piece = lambda t: tok.decode([t])  # noqa: E731
        if self.kind == "chat":
            def entry(t, lp):
                s = piece(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in entries]}
        tokens, offsets = [piece(e.token) for e in entries], []
        for t in tokens:  # character offset of each token in the completion text, running across chunks
            offsets.append(self.text_offset[choice])
            self.text_offset[choice] += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def chunk(self, choice: int, delta: Delta, reason: Optional[str], want_logprobs: bool) -> Optional[dict]:
        """One streaming chunk for a choice's update, or None when there is nothing to say."""
        if not delta and reason is None:
            return None
        lp = self._logprobs(choice, delta.logprobs) if want_logprobs and delta.logprobs else None
        if self.kind == "chat":
            d: dict[str, Any] = {}
            if delta.content:
                d["content"] = delta.content
            if delta.reasoning:
                d["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                d["tool_calls"] = []
                for tc in delta.tool_calls:
                    d["tool_calls"].append({"index": self.tool_index[choice], **tc})
                    self.tool_index[choice] += 1
            if not d and lp is None and reason is None:
                return None
            body = {"index": choice, "delta": d, "logprobs": lp, "finish_reason": reason}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.server.cfg.model_id,
                    "choices": [body], "usage": None}
        if not delta.content and lp is None and reason is None:
            return None
        body = {"index": choice, "text": delta.content, "logprobs": lp, "finish_reason": reason}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.server.cfg.model_id,
                "choices": [body], "usage": None}

    def final(self, want_logprobs: bool, echo_texts: Optional[list[str]] = None) -> dict:
        choices = []
        for c, d in enumerate(self.deltas):
            lp = self._logprobs(c, d.logprobs) if want_logprobs else None
            if self.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": d.content if d.content or not d.tool_calls else None}
                if d.reasoning:
                    msg["reasoning_content"] = d.reasoning
                if d.tool_calls:
                    msg["tool_calls"] = d.tool_calls
                choices.append({"index": c, "message": msg, "logprobs": lp, "finish_reason": self.finish[c]})
            else:
                text = (echo_texts[c] if echo_texts else "") + d.content
                choices.append({"index": c, "text": text, "logprobs": lp, "finish_reason": self.finish[c]})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.cfg.model_id,
                "choices": choices, "usage": self.usage()}


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _next_events(queue: asyncio.Queue, disconnect: asyncio.Task) -> Optional[list]:
    """All engine events available now (waiting for the first), or None if the client went away first."""
    if disconnect.done():
        return None
    if queue.empty():
        get = asyncio.ensure_future(queue.get())
        await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            return None
        events = list(get.result())
    else:
        events = []
    while not queue.empty():
        events += queue.get_nowait()
    return events


class EventStream:
    """SSE response (an ASGI callable) driven by the engine; cancels the request if the client disconnects."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

    def __init__(self, server: Server, collector: Collector, req: Request, queue: asyncio.Queue,
                 include_usage: bool, want_logprobs: bool, echo_texts: Optional[list[str]], endpoint: str, t0: float):
        self.server, self.col, self.req, self.queue = server, collector, req, queue
        self.include_usage, self.want_logprobs, self.echo_texts = include_usage, want_logprobs, echo_texts
        self.endpoint, self.t0 = endpoint, t0

    async def __call__(self, scope, receive, send) -> None:
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        col, status = self.col, "200"
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            for first in self._opening():
                await send({"type": "http.response.body", "body": sse(first), "more_body": True})
            while not col.done:
                events = await _next_events(self.queue, disconnect)
                if events is None:
                    status = "disconnected"
                    return
                out = []
                for ev in events:
                    for c, delta, reason in col.apply(ev):
                        ch = col.chunk(c, delta, reason, self.want_logprobs)
                        if ch is not None:
                            out.append(sse(ch))
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
            tail = []
            if col.error is not None:
                status = str(col.error.status)
                tail.append(sse(col.error.body()))
            elif self.include_usage:
                tail.append(sse({"id": col.id, "object": "chat.completion.chunk" if col.kind == "chat" else "text_completion",
                                 "created": col.created, "model": self.server.cfg.model_id, "choices": [], "usage": col.usage()}))
            tail.append(SSE_DONE)
            await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
        except OSError:
            status = "disconnected"
        except Exception as e:  # a bug while streaming: the headers are out, so say it as an event
            log.exception("stream of request %s failed", self.req.id)
            status = "500"
            err = APIError(f"internal error while streaming: {type(e).__name__}")
            try:
                await send({"type": "http.response.body", "body": sse(err.body()) + SSE_DONE, "more_body": False})
            except Exception:  # the connection is already unusable
                pass
        finally:
            disconnect.cancel()
            if not self.req.finished:
                self.req.cancelled = True
            self.server.metrics.requests.labels(self.endpoint, status).inc()
            self.server.metrics.latency.labels(self.endpoint).observe(time.monotonic() - self.t0)

    def _opening(self) -> list[dict]:
        """Chat streams open each choice with the assistant role; completions with echo open with the prompt."""
        col, out = self.col, []
        for c in range(col.n):
            if col.kind == "chat":
                out.append({"id": col.id, "object": "chat.completion.chunk", "created": col.created, "model": self.server.cfg.model_id,
                            "choices": [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                            "usage": None})
            elif self.echo_texts:
                out.append(col.chunk(c, Delta(content=self.echo_texts[c]), None, False))
        return out


class Mailbox:
    """Engine thread -> event loop: one loop wake-up per batch of posts, however many requests they are for."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, list]] = []

    def sink(self, queue: asyncio.Queue):
        def post(events: list) -> None:
            with self._lock:
                self._pending.append((queue, events))
                first = len(self._pending) == 1
            if first:
                self.loop.call_soon_threadsafe(self._deliver)
        return post

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, events in pending:
            queue.put_nowait(events)


async def _generate(server: Server, request: HTTPRequest, kind: str) -> Response:
    endpoint = request.url.path
    t0 = time.monotonic()
    try:
        server.check_available()
        server.check_auth(request)
        raw = await server.read_body(request)
        body = parse_json(raw)
        vocab = server.engine.vocab_size
        parsed = parse_chat(body, vocab) if kind == "chat" else parse_completion(body, vocab)
        server.check_model(parsed.model)
        loop = asyncio.get_running_loop()
        tok = server.tokenizer
        p = parsed.params
        if kind == "chat":
            prompt, snaps, state = await loop.run_in_executor(server.pool, server.chat_prompt, parsed)
            prompts, snap_lists, echo_texts = [prompt], [snaps], None
            outputs = [ChoiceOutput(tok, p.stop, chat=True, initial_state=state, tools=parsed.tools) for _ in range(p.n)]
        else:
            prompts = await loop.run_in_executor(server.pool, server.completion_prompts, parsed)
            snap_lists = [[len(x) - 1] for x in prompts]
            outputs = [ChoiceOutput(tok, p.stop, chat=False) for _ in range(len(prompts) * p.n)]
            echo_texts = None
            if parsed.echo:
                texts = parsed.prompts if isinstance(parsed.prompts[0], str) else [tok.decode(x) for x in prompts]
                echo_texts = [t for t in texts for _ in range(p.n)]
        max_new = [server.max_new(len(x), p.max_tokens, "messages" if kind == "chat" else "prompt") for x in prompts]
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(prompts, snap_lists, max_new, p, outputs, server.mailbox(loop).sink(queue), server.cfg.request_timeout)
        server.engine.submit(req)
    except ClientDisconnect:
        server.metrics.requests.labels(endpoint, "disconnected").inc()
        return Response(status_code=400)
    except APIError as e:
        server.metrics.requests.labels(endpoint, str(e.status)).inc()
        return error_response(e)
    col = Collector(server, kind, req.id, len(outputs), [len(x) for x in prompts])
    if parsed.stream:
        return EventStream(server, col, req, queue, parsed.include_usage, p.logprobs, echo_texts, endpoint, t0)
    disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        while not col.done:
            events = await _next_events(queue, disconnect)
            if events is None:
                req.cancelled = True
                server.metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
            for ev in events:
                col.apply(ev)
    finally:
        disconnect.cancel()
    server.metrics.latency.labels(endpoint).observe(time.monotonic() - t0)
    if col.error is not None:
        server.metrics.requests.labels(endpoint, str(col.error.status)).inc()
        return error_response(col.error)
    server.metrics.requests.labels(endpoint, "200").inc()
    return JSONResponse(col.final(p.logprobs, echo_texts))


def create_app(server: Server) -> Starlette:
    async def chat(request):
        return await _generate(server, request, "chat")

    async def completions(request):
        return await _generate(server, request, "completion")

    async def models(request):
        try:
            server.check_auth(request)
        except APIError as e:
            return error_response(e)
        card = {"id": server.cfg.model_id, "object": "model", "created": int(time.time()), "owned_by": "lily-mlx"}
        name = request.path_params.get("name")
        if name is None:
            return JSONResponse({"object": "list", "data": [card]})
        if name not in server.cfg.labels:
            return error_response(NotFound(f"the model '{name}' does not exist on this server", param="model", code="model_not_found"))
        return JSONResponse(card)

    async def health(request):
        e = server.engine
        if e.dead is not None:
            return JSONResponse({"status": "error", "detail": f"engine stopped: {type(e.dead).__name__}"}, status_code=503)
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not e.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": server.cfg.model_id})

    async def metrics(request):
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request, exc: HTTPException):
        kind = NotFound if exc.status_code == 404 else BadRequest
        err = kind(f"{request.method} {request.url.path}: {exc.detail}")
        err.status = exc.status_code
        return error_response(err, headers=getattr(exc, "headers", None))

    async def server_error(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}"))

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
