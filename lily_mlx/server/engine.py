"""The one engine loop: a thread that owns the model and batches every running request.

Each iteration reaps cancelled / timed-out work, runs one prefill chunk of the request at the head
of the queue (batch 1, resuming from the prefix cache; with switch batched_prefill the whole prompts
queued behind it too, in one left-padded forward), then one decode step of all running
sequences together: a [B, 1] forward over mlx-lm's BatchKVCache (attention) and ArraysCache
(DeltaNet) rows, per-row logits processors and samplers, and the text pipeline of each choice. A
sequence running alone decodes through the compiled step (lily_mlx.decode.CompiledDecoder) over its
own prompt cache; a second arrival moves it into a batch of fixed row slots (SlotBatchDecoder, compiled,
traced once a slot count and capacity) that rows join and leave by slot; the slots shrink to the row bucket
the rows need and back to the compiled single step when one row is left. Without compiled_decode the rows
decode eagerly over mlx-lm's BatchKVCache / ArraysCache. Decode steps are pipelined (switch `server_pipeline`): the next step is queued on the GPU,
fed the tokens the host has not read yet, before the host reads, detokenizes and streams the last step's; rows
joining and leaving keep the pipeline going.
A failing request is answered with an error and dropped; if the loop itself fails, every open
request gets an error and `on_death` is called (the server then exits non-zero).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from ..decode import CompiledDecoder, SlotBatchDecoder
from ..memory import bounded_prefill
from .. import ops
from ..ops.kernels import row_bucket
from . import warm_up
from .metrics import Metrics
from .output import ChoiceOutput, TokenLogprob
from .prefix_cache import PrefixCache, Snapshot, restore, snapshot
from .schema import APIError, BadRequest, SamplingParams

log = logging.getLogger("lily_mlx.server")
# Prompts queued together prefill in one left-padded forward (stock mlx-lm's server: --prompt-concurrency 8), where
# one at a time each held every running row for a whole forward. On CUDA by default: 8 clients 1.21x the tokens a
# second, latency p50 0.82 against ~1.0 s, TTFT p50 0.26 against 0.195 s (H100 run 91); the same text as one at a
# time with CUDA's kernels (run 92). On a CPU it loses (8 single prefills take as long as one grouped).
PREFILL_BATCH = 8
ops.register_switch("batched_prefill", "the server prefills the whole prompts queued together in one left-padded "
                    "forward, each row then split into its own cache", default_on="cuda")
ops.register_switch("server_pipeline", "the server queues each decode step before it reads the last step's tokens, so "
                    "the host's reading and streaming overlap the GPU's work")


class QueueFull(APIError):
    status, type = 429, "rate_limit_error"


class Unavailable(APIError):
    status, type = 503, "server_error"


class Timeout(APIError):
    status, type = 504, "timeout_error"


class Request:
    """One API request as the engine sees it. Events reach `sink` in batches, from the engine thread:
    ("prompt", prompt_index, cached_tokens), ("delta", choice, Delta),
    ("finish", choice, finish_reason, Delta, completion_tokens), ("error", APIError)."""

    def __init__(self, prompts: list[list[int]], snap_positions: list[list[int]], max_new: list[int],
                 params: SamplingParams, outputs: list[ChoiceOutput], sink: Callable[[list], None], timeout: float):
        if len(outputs) != len(prompts) * params.n:
            raise ValueError(f"{len(outputs)} outputs for {len(prompts)} prompts x n={params.n}")
        self.id = uuid.uuid4().hex
        self.prompts, self.snap_positions, self.max_new = prompts, snap_positions, max_new
        self.params, self.outputs, self.sink = params, outputs, sink
        self.created = time.monotonic()
        self.deadline = self.created + timeout
        self.cancelled = False  # set by the HTTP side when the client goes away
        self.finished = False  # set by the engine: every choice done, or failed
        self.first_token_at: Optional[float] = None
        self._open = len(outputs)
        self._events: list = []

    def push(self, event: tuple) -> None:
        self._events.append(event)

    def flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            try:
                self.sink(events)
            except Exception:  # the HTTP side is gone (its loop closed); nothing left to tell
                self.cancelled = True

    def choice_done(self) -> None:
        self._open -= 1
        if self._open == 0:
            self.finished = True

    def fail(self, error: APIError) -> None:
        if not self.finished:
            self.finished = True
            self._events.append(("error", error))
            self.flush()


@dataclass
class Job:
    """One prompt of a request: prefilled once at batch 1, then forked into n decode rows."""

    req: Request
    index: int
    tokens: list[int]
    snaps: list[int]  # positions (< len(tokens)) to snapshot into the prefix cache
    cache: Optional[list] = None
    pos: int = 0


@dataclass
class Row:
    req: Request
    choice: int
    out: ChoiceOutput
    last: int
    max_new: int
    key: mx.array
    sampler: Optional[Callable]
    processors: list
    bias: Optional[mx.array]  # dense logit_bias [V], added to the whole batch at once
    generated: list[int] = field(default_factory=list)
    slot: Optional[int] = None  # the row's slot in the engine's SlotBatchDecoder
    # What the processors read, on the GPU: the prompt's last `history_prompt` tokens, then every sampled token, the
    # ones the host has not read yet included (so a pipelined step's processors see the step before it).
    history: Optional[mx.array] = None
    history_prompt: int = 0


@dataclass
class QueuedStep:
    """A decode step on the GPU whose tokens the host has not read yet: rows [B] as they were when it was queued."""

    rows: list[Row]
    tokens: mx.array  # [B] the sampled token ids
    chosen: mx.array  # [B] the tokens' log-probabilities
    top: Optional[tuple[mx.array, mx.array]]  # ([B, k] token ids, [B, k] log-probabilities) when a row asks for them


def _same_rows(a: list[Row], b: list[Row]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def make_row_sampler(p: SamplingParams) -> Optional[Callable]:
    """mlx-lm's filters (top_p, min_p, top_k, in make_sampler's order) and a categorical draw with the row's
    own key, so a seeded request is reproducible whatever else is in the batch. None means greedy."""
    if p.greedy:
        return None
    filters = []
    if 0 < p.top_p < 1:
        filters.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0:
        filters.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        filters.append(lambda x: apply_top_k(x, p.top_k))
    inv_temp = 1.0 / p.temperature

    def sample(logprobs: mx.array, key: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sample


def make_processors(p: SamplingParams, max_new: int) -> list[tuple[Callable, Optional[int]]]:
    """mlx-lm's penalty processors as (processor, context) pairs: context None = the generated tokens (OpenAI's
    presence/frequency semantics), an int = that many last tokens of prompt + output (its repetition penalty)."""
    procs: list[tuple[Callable, Optional[int]]] = []
    if p.repetition_penalty != 1.0:
        procs.append((make_repetition_penalty(p.repetition_penalty, p.repetition_context_size), p.repetition_context_size))
    if p.presence_penalty:
        procs.append((make_presence_penalty(p.presence_penalty, max_new), None))
    if p.frequency_penalty:
        procs.append((make_frequency_penalty(p.frequency_penalty, max_new), None))
    return procs


def _sequence_layers(cache: list) -> bool:
    """Whether every layer is mlx-lm's KVCache or ArraysCache: what batch caches split back into (extract) and what a
    SlotBatchDecoder's slots are laid out from."""
    return all(type(c) in (KVCache, ArraysCache) for c in cache)


def _as_batch(cache: list, n: int) -> list:
    """A sequence's cache (KVCache / ArraysCache per layer) as n rows of batch caches (BatchKVCache / ArraysCache)."""
    return [BatchKVCache.merge([c] * n) if isinstance(c, KVCache) else ArraysCache.merge([c] * n) for c in cache]


class Engine:
    def __init__(self, loader: Callable[[], tuple[Any, Any]], *, max_batch: int = 32, max_queue: int = 64,
                 prefill_step: int = 512, prefix_cache: Optional[PrefixCache] = None,
                 metrics: Optional[Metrics] = None, on_death: Optional[Callable[[BaseException], None]] = None,
                 warmup: bool = False, warm_up_workers: int = 0, model_path: Optional[str] = None):
        if max_batch < 1 or max_queue < 0 or prefill_step < 1:
            raise ValueError(f"max_batch={max_batch}, max_queue={max_queue}, prefill_step={prefill_step}: out of range")
        self.loader = loader
        self.max_batch, self.max_queue, self.prefill_step = max_batch, max_queue, prefill_step
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0)
        self.metrics = metrics or Metrics()
        self.on_death = on_death
        self.warmup = warmup
        # With warm_up_workers, that many processes holding a few layers of model_path (the loader's checkpoint)
        # run the warm-up's pieces side by side first (warm_up.py).
        self.warm_up_workers, self.model_path = warm_up_workers, model_path
        self.model = self.tokenizer = None
        self.vocab_size = 0
        self.ready = threading.Event()
        self.dead: Optional[BaseException] = None
        self.draining = False
        self._cv = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._jobs: deque[Job] = deque()
        self._prefill: Optional[Job] = None
        self._rows: list[Row] = []
        self._cache: Optional[list] = None
        self._solo: Optional[CompiledDecoder] = None  # the compiled step of a sequence running alone, over _cache
        self._slots: Optional[SlotBatchDecoder] = None  # the compiled step of several rows (then _cache is None)
        self._bias: Optional[mx.array] = None  # [B, V] logit_bias of the current rows; rebuilt when rows change
        self._queued: Optional[QueuedStep] = None  # the next step, queued before the last one was read (pipelined)
        self._live: dict[str, Request] = {}  # every admitted, unfinished request: what a dying loop must answer
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lily-engine", daemon=True)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        with self._cv:
            if self.dead is not None:
                raise Unavailable("the engine has stopped after an internal error", code="engine_dead")
            if self.draining or self._stop:
                raise Unavailable("the server is shutting down and accepts no new requests", code="draining")
            if not self.ready.is_set():
                raise Unavailable("the model is still loading", code="loading")
            if req.params.n > self.max_batch:
                raise BadRequest(f"n={req.params.n} is more than this server decodes at once (--max-batch {self.max_batch})", param="n")
            queued = len(self._incoming) + len({id(j.req) for j in self._jobs})
            if queued >= self.max_queue:
                raise QueueFull(f"the request queue is full ({queued} waiting, --max-queue {self.max_queue}); retry later", code="queue_full")
            self._incoming.append(req)
            self._cv.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._incoming or self._jobs or self._prefill or self._rows)

    def drain(self) -> None:
        """Refuse new requests; those already accepted run to completion."""
        with self._cv:
            self.draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; whatever is still open is answered with a 503 error."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        workers = []
        try:
            if self.warmup and self.warm_up_workers and self.model_path:  # they build while this process loads
                workers = warm_up.start_workers(self.model_path, [label for label, _ in warm_up.pieces(self)],
                                                self.warm_up_workers, self.max_batch, self.prefill_step)
            self.model, self.tokenizer = self.loader()
            cfg = getattr(self.model, "config", None)
            self.vocab_size = getattr(cfg, "vocab_size", None) or len(self.tokenizer)
            self.eos = set(self.tokenizer.eos_token_ids)
            if self.warmup:
                warm_up.wait_workers(workers, warm_up.WORKERS_TIMEOUT)
                self._warm_up()
            self.ready.set()
            log.info("model ready (vocab %d)", self.vocab_size)
            while self._iteration():
                pass
            self._abort_all(Unavailable("the server shut down before this request finished", code="shutdown"))
        except BaseException as e:  # the loop itself failed: tell everyone, then let the process exit non-zero
            log.critical("engine loop died: %s: %s", type(e).__name__, e, exc_info=True)
            with self._cv:
                self.dead = e
            self._abort_all(Unavailable(f"the engine stopped after an internal error ({type(e).__name__})", code="engine_dead"))
            if self.on_death is not None:
                self.on_death(e)
        finally:
            for p in workers:  # the loader failed while they ran
                if p.poll() is None:
                    p.kill()

    def _warm_up(self) -> None:
        """Runs once what the first requests would otherwise build inside them (a GPU kernel's JIT build takes seconds
        on a machine without its kernel caches) before /health says ready (warm_up.pieces lists them)."""
        t0 = time.monotonic()
        for label, run in warm_up.pieces(self):
            with warm_up.timed(label):
                run()
        log.info("warm-up: decode steps of 1 to %d rows, prefills of %s tokens, built in %.1f s",
                 warm_up.decode_rows(self.max_batch)[-1], "/".join(map(str, warm_up.prefill_lengths(self.prefill_step))),
                 time.monotonic() - t0)

    def _iteration(self) -> bool:
        with self._cv:
            while not (self._incoming or self._jobs or self._prefill or self._rows or self._stop):
                self._cv.wait()
            if self._stop:
                return False
            new = list(self._incoming)
            self._incoming.clear()
        for req in new:
            self._live[req.id] = req
            self._jobs.extend(Job(req, i, toks, snaps) for i, (toks, snaps) in enumerate(zip(req.prompts, req.snap_positions)))
        self._reap()
        self._prefill_chunk()
        self._decode_step()
        m = self.metrics
        m.queue_depth.set(len({id(j.req) for j in self._jobs}))
        m.running.set(len(self._rows))
        m.cache_bytes.set(self.prefix_cache.bytes)
        m.cache_entries.set(len(self.prefix_cache))
        return True

    def _reap(self) -> None:
        """Drop the work of requests that were cancelled, failed or ran past their deadline."""
        now = time.monotonic()
        for req in self._live.values():
            if not req.finished and not req.cancelled and now > req.deadline:
                req.fail(Timeout("the request ran past the server's --request-timeout", code="request_timeout"))
                log.warning("request %s timed out", req.id)
        gone = lambda r: r.finished or r.cancelled  # noqa: E731
        self._live = {k: r for k, r in self._live.items() if not gone(r)}
        self._jobs = deque(j for j in self._jobs if not gone(j.req))
        if self._prefill is not None and gone(self._prefill.req):
            self._prefill = None
        self._filter_rows([i for i, r in enumerate(self._rows) if not gone(r.req)])

    def _filter_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._drop_rows()
            return
        self._bias = None
        kept = set(keep)
        left = [r for i, r in enumerate(self._rows) if i not in kept]
        self._rows = [self._rows[i] for i in keep]
        if self._slots is None:
            for c in self._cache:
                c.filter(keep)
            return
        for r in left:
            self._slots.leave(r.slot)
        self._fit_slots()

    def _fit_slots(self) -> None:
        """After rows left: one row left goes on in the compiled single step; else the slots shrink to the row bucket
        the rows need (a smaller batch's step costs less)."""
        if len(self._rows) == 1:
            r = self._rows[0]
            cache = self._slots.sequence_cache(r.slot)
            if CompiledDecoder.applicable(self.model, cache):
                self._solo = CompiledDecoder(self.model, cache, reserve=min(r.max_new - len(r.generated) + 1, 2048))
                self._cache, self._slots, r.slot = cache, None, None
                return
        if row_bucket(len(self._rows)) < self._slots.slots:
            moved = self._slots.compact(row_bucket(len(self._rows)))
            for r in self._rows:
                r.slot = moved[r.slot]

    def _abort_all(self, error: APIError) -> None:
        with self._cv:
            reqs = list(self._incoming)
            self._incoming.clear()
        for req in reqs + list(self._live.values()):
            req.fail(error)
        self._live.clear()
        self._jobs.clear()
        self._drop_rows()
        self._prefill = None

    def _drop_rows(self) -> None:
        """No rows decoding: their caches, compiled steps, logit_bias and queued step go with them."""
        self._rows, self._cache, self._bias, self._solo, self._slots, self._queued = [], None, None, None, None, None

    def _start_job(self) -> None:
        while self._jobs and self._prefill is None:
            job = self._jobs[0]
            if len(self._rows) + job.req.params.n > self.max_batch:
                return  # wait for rows to free up
            self._jobs.popleft()
            self._admit(job, self.prefix_cache.lookup(job.tokens, job.snaps))
            if job.pos == len(job.tokens) - 1:
                self._add_rows(job)
            else:
                self._prefill = job

    def _admit(self, job: Job, snap: Optional[Snapshot]) -> None:
        """A queued job's prompt cache: from snap (the prefix cache's lookup of its prompt), else empty."""
        if self.prefix_cache.enabled:
            self.metrics.cache_lookups.labels("hit" if snap else "miss").inc()
        if snap is not None:
            job.cache, job.pos = restore(snap.layers, snap.length), snap.length
            self.metrics.cached_tokens.inc(snap.length)
        else:
            job.cache = self.model.make_cache()
        self.metrics.prompt_tokens.inc(len(job.tokens))
        job.req.push(("prompt", job.index, job.pos))
        job.req.flush()

    def _prefill_chunk(self) -> None:
        """Up to prefill_step tokens of the head job, stopping at snapshot positions and multiples of the step
        (a fixed split, so a prompt resumed from a snapshot computes exactly what a full prefill would); with the
        queued prompts behind it in one forward where they can (_prefill_group)."""
        self._start_job()
        job = self._prefill
        if job is None:
            return
        group = self._prefill_group(job)
        if len(group) > 1:
            self._prefill_together(group)
            return
        end = len(job.tokens) - 1  # the last prompt token is the first decode input
        target = min([end, (job.pos // self.prefill_step + 1) * self.prefill_step] + [s for s in job.snaps if s > job.pos])
        try:
            with bounded_prefill():
                self.model(mx.array(job.tokens[job.pos:target])[None], cache=job.cache)
                mx.eval([c.state for c in job.cache])
            job.pos = target
            if target in job.snaps and not self.prefix_cache.contains(job.tokens, target):
                self.prefix_cache.insert(job.tokens, target, snapshot(job.cache, target))
        except Exception as e:
            log.exception("prefill of request %s failed", job.req.id)
            job.req.fail(APIError(f"prefill failed: {type(e).__name__}: {e}", code="prefill_failed"))
            self._prefill = None
            return
        if job.pos == end:
            self._prefill = None
            self._add_rows(job)

    def _whole(self, job: Job) -> bool:
        """Whether a job's prompt can be prefilled with others: all of it (but the last token) from position 0 in one
        chunk, with no snapshot to take before its end, into a cache of the layer types the rows split back into."""
        end = len(job.tokens) - 1
        snaps_inside = self.prefix_cache.enabled and any(job.pos < s < end for s in job.snaps)
        types_ok = job.cache is None or _sequence_layers(job.cache)
        return job.pos == 0 and 0 < end <= self.prefill_step and not snaps_inside and types_ok

    def _prefill_group(self, head: Job) -> list[Job]:
        """head and the queued jobs right behind it that one left-padded forward prefills with it (switch
        batched_prefill): whole prompts (_whole) not resuming from the prefix cache, at most PREFILL_BATCH of them,
        their padded tokens within --prefill-step and their rows within --max-batch."""
        if not ops.enabled("batched_prefill") or not self._whole(head):
            return [head]
        group, rows = [head], len(self._rows) + head.req.params.n
        while self._jobs and len(group) < PREFILL_BATCH:
            job = self._jobs[0]
            longest = max(len(j.tokens) - 1 for j in (*group, job))
            if rows + job.req.params.n > self.max_batch or longest * (len(group) + 1) > self.prefill_step \
                    or not self._whole(job) or self.prefix_cache.lookup(job.tokens, job.snaps) is not None:
                break  # a job the prefix cache resumes is admitted alone, where it is looked up again
            self._jobs.popleft()
            self._admit(job, None)
            group.append(job)
            rows += job.req.params.n
        return group

    def _prefill_together(self, group: list[Job]) -> None:
        """The jobs' prompts (but their last tokens) in one forward, left-padded to the longest over mlx-lm's
        BatchKVCache / ArraysCache (the padding masked), each row then taken out as its job's own cache."""
        lengths = [len(j.tokens) - 1 for j in group]
        self._prefill = None
        try:
            with bounded_prefill():
                cache = self._prefill_rows([j.tokens[:n] for j, n in zip(group, lengths)])
                mx.eval([c.state for c in cache])
            for i, job in enumerate(group):
                job.cache, job.pos = [c.extract(i) for c in cache], lengths[i]
                if job.pos in job.snaps and not self.prefix_cache.contains(job.tokens, job.pos):
                    self.prefix_cache.insert(job.tokens, job.pos, snapshot(job.cache, job.pos))
        except Exception as e:
            log.exception("prefill of %d prompts together failed", len(group))
            for job in group:
                job.req.fail(APIError(f"prefill failed: {type(e).__name__}: {e}", code="prefill_failed"))
            return
        for job in group:
            self._add_rows(job)

    def _prefill_rows(self, prompts: list[list[int]]) -> list:
        """The prompts in one forward, left-padded to the longest -> its cache: mlx-lm's BatchKVCache / ArraysCache
        (the padding masked), one row a prompt."""
        longest = max(map(len, prompts))
        pad = [longest - len(t) for t in prompts]
        tokens = mx.array([[0] * p + t for p, t in zip(pad, prompts)])  # [B, longest]
        cache = [BatchKVCache(pad) if type(c) is KVCache else ArraysCache(len(c.cache), left_padding=pad)
                 for c in self.model.make_cache()]
        self.model(tokens, cache=cache)
        return cache

    def _add_rows(self, job: Job) -> None:
        req, n = job.req, job.req.params.n
        slots = self._join(job.cache, n, req.max_new[job.index])
        p = req.params
        seed = p.seed if p.seed is not None else secrets.randbits(64)
        keys = mx.random.split(mx.random.key(seed % 2**64), len(req.prompts) * n)
        max_new = req.max_new[job.index]
        bias = None
        if p.logit_bias:
            bias = mx.zeros((self.vocab_size,), dtype=mx.float32)
            bias[mx.array(list(p.logit_bias))] = mx.array(list(p.logit_bias.values()), dtype=mx.float32)
        self._bias = None
        processors = make_processors(p, max_new)  # stateless: the rows of a request share them
        kept = max((c for _, c in processors if c is not None), default=0)  # the prompt tokens they read
        tail = job.tokens[max(0, len(job.tokens) - kept):] if kept else []
        for j in range(n):
            choice = job.index * n + j
            self._rows.append(Row(req, choice, req.outputs[choice], job.tokens[-1], max_new,
                                  keys[choice], make_row_sampler(p), processors, bias, slot=slots[j],
                                  history=mx.array(tail, dtype=mx.uint32) if processors else None,
                                  history_prompt=len(tail)))

    def _join(self, cache: list, n: int, max_new: int) -> list[Optional[int]]:
        """A prefilled sequence cache into the decoding rows as n rows -> their slots (None outside a slot batch).
        Alone it decodes in the compiled single step (in one slot where nothing is prefilled in it); with others in a
        SlotBatchDecoder, grown to the row bucket they need; where neither applies (compiled_decode off), eagerly in
        batch caches."""
        if not self._rows and n == 1 and CompiledDecoder.applicable(self.model, cache):
            self._cache, self._solo = cache, CompiledDecoder(self.model, cache, reserve=min(max_new + 1, 2048))
            return [None]
        if self._solo is not None:  # the lone row's state back into its cache, to join a batch
            self._solo.write_back()
            self._solo, solo_cache, self._cache = None, self._cache, None
            if SlotBatchDecoder.applicable(self.model, solo_cache):
                self._slots = SlotBatchDecoder(self.model, solo_cache, row_bucket(1 + n))
                self._rows[0].slot = self._slots.join(solo_cache)
            else:
                self._cache = _as_batch(solo_cache, 1)
        elif not self._rows and (layout := self._slot_layout(cache)) is not None:
            self._slots = SlotBatchDecoder(self.model, layout, row_bucket(n))
        if self._slots is not None:
            if len(self._rows) + n > self._slots.slots:
                self._slots.grow(row_bucket(len(self._rows) + n))
            return [self._slots.join(cache) for _ in range(n)]
        new = _as_batch(cache, n)
        if self._cache is None:
            self._cache = new
        else:
            for a, b in zip(self._cache, new):
                a.extend(b)
        return [None] * n

    def _slot_layout(self, cache: list) -> Optional[list]:
        """The cache a SlotBatchDecoder for this sequence is laid out from: its own, or where nothing is prefilled in
        it (a one-token prompt) a one-token forward's, built but never run (the decoder reads only its shapes)."""
        if SlotBatchDecoder.applicable(self.model, cache):
            return cache
        if not ops.enabled("compiled_decode") or not _sequence_layers(cache):
            return None
        filled = self.model.make_cache()
        self.model(mx.zeros((1, 1), mx.int32), cache=filled)
        return filled if SlotBatchDecoder.applicable(self.model, filled) else None

    def _decode_step(self) -> None:
        """One decode step's tokens read and fed to their rows. Pipelined, the next step over the rows as they are
        now is queued first: its inputs the unread tokens of the rows the queued step ran, the last token of rows
        that joined since."""
        queued, self._queued = self._queued, None
        pipelined = ops.enabled("server_pipeline")
        if queued is not None and not pipelined:
            self._read(queued)
            queued = None
        if not self._rows:
            return
        try:
            if queued is None:
                queued = self._queue_step(self._inputs(None))
            ran = {id(r) for r in queued.rows}
            if pipelined and any(len(r.generated) + (id(r) in ran) < r.max_new for r in self._rows):  # one goes on
                self._queued = self._queue_step(self._inputs(queued))
        except Exception as e:  # building a step failed: one batched forward, no single request to blame
            self._fail_rows(e)
            return
        self._read(queued)

    def _inputs(self, queued: Optional[QueuedStep]) -> mx.array:
        """[B, 1] each row's next input: the queued step's unread token in the rows it ran, else the row's last."""
        rows = self._rows
        last = mx.array([[r.last] for r in rows])
        if queued is None:
            return last
        if _same_rows(queued.rows, rows):
            return queued.tokens[:, None]
        at = {id(r): j for j, r in enumerate(queued.rows)}
        picked = queued.tokens[mx.array([at.get(id(r), 0) for r in rows])][:, None]
        return mx.where(mx.array([[id(r) in at] for r in rows]), picked, last.astype(picked.dtype))

    def _queue_step(self, inputs: mx.array) -> QueuedStep:
        """One decode step of every row, from inputs [B, 1], queued on the GPU (mx.async_eval)."""
        rows = list(self._rows)
        logits = self._step(inputs).astype(mx.float32)  # [B, V]
        logits = self._process(rows, logits)
        logprobs, greedy = ops.to_logprobs(logits, greedy=True)
        tokens = self._sample(rows, logprobs, greedy)  # [B]
        for i, r in enumerate(rows):
            if r.history is not None:
                r.history = mx.concatenate([r.history, tokens[i:i + 1].astype(mx.uint32)])
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        k = max((r.req.params.top_logprobs for r in rows if r.req.params.logprobs), default=0)
        top = None
        if k:
            top_i = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            top = top_i, mx.take_along_axis(logprobs, top_i, axis=-1)
        mx.async_eval(tokens, chosen, *(top or ()))
        return QueuedStep(rows, tokens, chosen, top)

    def _fail_rows(self, e: Exception) -> None:
        log.exception("decode step failed; failing %d sequences", len(self._rows))
        for r in self._rows:
            r.req.fail(APIError(f"generation failed: {type(e).__name__}: {e}", code="decode_failed"))
        self._drop_rows()

    def _read(self, step: QueuedStep) -> None:
        """The step's tokens fed to those of its rows still running; the rows that stop leave the batch."""
        try:
            toks, lps = step.tokens.tolist(), step.chosen.tolist()
            top_i, top_v = (step.top[0].tolist(), step.top[1].tolist()) if step.top else (None, None)
        except Exception as e:  # its forward failed on the GPU
            self._fail_rows(e)
            return
        running = {id(r) for r in self._rows}
        live = [(i, r) for i, r in enumerate(step.rows) if id(r) in running and not r.req.finished]
        if live:  # not a step whose rows all stopped while it was queued
            self.metrics.decode_steps.inc()
            self.metrics.completion_tokens.inc(len(live))
        stopped, touched = set(), {}
        now = time.monotonic()
        for i, r in live:
            touched[id(r.req)] = r.req
            if r.req.first_token_at is None:
                r.req.first_token_at = now
                self.metrics.ttft.observe(now - r.req.created)
            try:
                lp = None
                if r.req.params.logprobs:
                    n_top = r.req.params.top_logprobs
                    top = sorted(zip(top_i[i], top_v[i]), key=lambda t: -t[1])[:n_top] if n_top else []
                    lp = TokenLogprob(toks[i], lps[i], top)
                if not self._advance(r, toks[i], lp):
                    stopped.add(id(r))
            except Exception as e:
                log.exception("output processing of request %s failed", r.req.id)
                r.req.fail(APIError(f"output processing failed: {type(e).__name__}: {e}", code="output_failed"))
        for req in touched.values():
            req.flush()
        self._filter_rows([i for i, r in enumerate(self._rows) if id(r) not in stopped and not r.req.finished])

    def _step(self, inputs: mx.array) -> mx.array:
        """Logits [B, V] of one decode step of every row from inputs [B, 1]: compiled alone or in slots, else eager."""
        if self._solo is not None:
            return self._solo(inputs)
        if self._slots is None:
            return self.model(inputs, cache=self._cache)[:, -1, :]
        taken = [r.slot for r in self._rows]
        if taken == list(range(self._slots.slots)):
            return self._slots(inputs)
        at = mx.array(taken)
        full = mx.zeros((self._slots.slots, 1), dtype=inputs.dtype)  # a free slot's input: token 0, its output unread
        full[at] = inputs
        return self._slots(full)[at]

    def _advance(self, r: Row, token: int, lp: Optional[TokenLogprob]) -> bool:
        """Feed one sampled token to its row. -> whether the row keeps generating."""
        r.generated.append(token)
        r.last = token
        if token in self.eos:
            reason, delta = "stop", r.out.finish("stop")
        else:
            delta, stopped = r.out.feed(token, lp)
            if stopped:
                reason = "stop"
                delta.extend(r.out.finish("stop_string"))
            elif len(r.generated) >= r.max_new:
                reason = "length"
                delta.extend(r.out.finish("length"))
            else:
                if delta:
                    r.req.push(("delta", r.choice, delta))
                return True
        if reason == "stop" and r.out.made_tool_call:
            reason = "tool_calls"
        r.req.push(("finish", r.choice, reason, delta, len(r.generated)))
        r.req.choice_done()
        return False

    def _process(self, rows: list[Row], logits: mx.array) -> mx.array:
        if any(r.bias is not None for r in rows):
            if self._bias is None:
                zero = mx.zeros((logits.shape[-1],), dtype=mx.float32)
                self._bias = mx.stack([zero if r.bias is None else r.bias for r in rows])
            logits = logits + self._bias
        if not any(r.processors for r in rows):
            return logits
        out = []
        for i, r in enumerate(rows):
            row = logits[i: i + 1]
            for proc, context in r.processors:  # context None: the generated tokens; else the last `context`
                row = proc(r.history[r.history_prompt:] if context is None else r.history[-context:], row)
            out.append(row)
        return mx.concatenate(out, axis=0)

    def _sample(self, rows: list[Row], logprobs: mx.array, tokens: mx.array) -> mx.array:
        """tokens [B]: the greedy ones, replaced in the rows that sample."""
        sampled = [i for i, r in enumerate(rows) if r.sampler is not None]
        if sampled:
            picks = []
            for i in sampled:
                r = rows[i]
                r.key, sub = mx.random.split(r.key)
                picks.append(r.sampler(logprobs[i: i + 1], sub))
            tokens[mx.array(sampled)] = mx.concatenate(picks).astype(tokens.dtype)
        return tokens
