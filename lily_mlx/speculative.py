"""Speculative decoding with the checkpoint's own multi-token-prediction (MTP) head, one draft token a forward.

Each forward of the main model takes the tokens it has not absorbed yet ("pending": the last sampled token, and after
a rejection every token since the last accepted draft) and the MTP head's draft for the next position. The main
model's own sample at the draft's position decides: equal, the draft stands and the sample after it is kept too (two
tokens for one forward); different, the sample replaces the draft. Every token is the main model's sample given the
tokens before it (mlx-lm's rule for draft models), so greedy output is the plain decoder's and sampled output has its
distribution.

A rejected draft has already entered the DeltaNet states and the KV caches. The states from before the forward are
kept (MLX arrays are immutable: keeping them costs nothing) and put back, the KV caches trimmed back, and the pending
tokens go through again with the next draft: no forward of its own for a rejection, one more token in the next. With
switch verify_keep (on by default on CUDA) the forward also keeps the DeltaNet states from before its draft
(deltanet_step's KEEP), and a rejection rolls back to those instead: its other tokens stand, and every forward is the
last sample and a draft. The MTP head's KV cache holds one entry per main-model position t, from the main model's final-norm hidden
state at t and token t+1.

The host does not wait with the GPU idle: while it waits for a forward's samples, the next draft and forward are
already queued as if the draft stood (the plain decoder's pipelining, one forward ahead). A rejection undoes both
(the main model's state as above, the head's cache by its length) before the pending tokens go again. With switch
mtp_resident the GPU decides instead: the next forward takes [s2, its draft] from the states after both tokens where
the draft stood, else [s1, its draft] from the states before the draft, its offset one further where it stood, and
the head drafts from the position the decision picks. No forward is queued on a guess, so none is wasted; the host
only reads each forward's samples, one forward behind.

Both run compiled per token count (decode.CompiledVerifier, decode.CompiledDrafter) where the compiled decode step
applies, and the verify forward takes the decode kernels over its 2-5 tokens (model.DECODE_TOKENS_MAX): as many
launches as a one-token step.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, List, NamedTuple, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from . import ops
from .decode import STEP, CompiledDrafter, CompiledVerifier, verify_outputs
from .generation import sample_logprobs
from .memory import bounded_prefill

# Pending tokens (after rejections in a row) past which they are absorbed by a forward of their own, so a run of
# rejections does not grow the verify forward without bound.
MAX_PENDING = 4


def check_model(model) -> None:
    """A clear error when `model` cannot draft with an MTP head."""
    from .model import Model

    if not isinstance(model, Model):
        raise ValueError(f"mtp: speculative decoding with an MTP head needs a lily_mlx model, got {type(model).__name__}")
    if "mtp" not in model:
        raise ValueError("mtp: this checkpoint has no MTP head (no mtp.* tensors): load one that has them")


def _check_cache(cache: List[Any]) -> None:
    for i, c in enumerate(cache):
        if type(c) not in (KVCache, ArraysCache):
            raise ValueError(f"mtp: layer {i}'s cache is a {type(c).__name__}; speculative decoding rolls back only "
                             "mlx-lm's KVCache and ArraysCache (no max_kv_size window, no kv_bits)")


class _Eager:
    """The main model over mlx-lm's caches, eagerly (CompiledVerifier's interface): rolled back by keeping the
    DeltaNet [conv state, state] arrays and trimming the KV caches."""

    def __init__(self, model, cache: List[Any]):
        self.model, self.cache = model, cache

    def __call__(self, tokens: mx.array) -> Tuple[mx.array, mx.array]:
        """tokens [1, T] -> the last two positions' final-norm hidden states [1, min(T, 2), H] and logits."""
        return verify_outputs(self.model, tokens, self.cache)

    def snapshot(self) -> list:
        return [list(c.cache) if isinstance(c, ArraysCache) else c.offset for c in self.cache]

    def kept(self) -> None:
        """No states before a forward's last token (CompiledVerifier's with switch verify_keep): a rejection restores
        the snapshot from before the forward."""
        return None

    def restore(self, snapshot: list) -> None:
        for c, saved in zip(self.cache, snapshot):
            if isinstance(c, ArraysCache):
                c.cache = list(saved)
            else:
                c.trim(c.offset - saved)

    def write_back(self) -> None:
        pass


class _EagerDrafter(_Eager):
    """The MTP head over its mlx-lm KVCaches, eagerly (CompiledDrafter's interface), until the compiled draft
    applies; rolled back as _Eager rolls back its KV caches."""

    def __call__(self, hidden: mx.array, next_tokens: mx.array) -> mx.array:
        return self.model.mtp_draft(hidden, next_tokens, self.cache)


class _Forward(NamedTuple):
    """One verify forward in flight: its draft d [1], the samples at the draft's position (s1) and after it (s2) with
    their log-probabilities, and its last two positions' hidden states. The host's loop keeps the state before it
    (`before`) and with verify_keep before its draft (`kept`: a restore() snapshot), and the tokens it was given
    (`pending`: known ids, or None while they are another forward's lazy samples). The GPU's (mtp_resident) keeps
    its offset (`offset4`: a [4] int32 whose first entry the kernels read) and the DeltaNet states it leaves after
    both tokens (`after`) and before its draft (`kept`)."""

    d: mx.array
    s1: mx.array
    lp1: mx.array
    s2: mx.array
    lp2: mx.array
    hidden: mx.array
    before: Any = None
    kept: Any = None
    pending: Optional[List[int]] = None
    offset4: Optional[mx.array] = None
    after: Any = None


def _hand_out(ready: list, yielded: int, max_tokens: int):
    """Yields the decided tokens until max_tokens have been yielded in all; returns how many have. MLX's buffer cache
    is cleared every 256 tokens, as mlx-lm's loop does."""
    for item in ready:
        if yielded == max_tokens:
            break
        yield item
        yielded += 1
        if yielded % 256 == 0:
            mx.clear_cache()
    return yielded


def _settle(main, snapshot, missing: List[int]) -> None:
    """The caller's cache after generation: the prompt and the yielded tokens, no draft. main is restored to
    `snapshot`, takes the yielded tokens it lacks (`missing`) and writes back."""
    main.restore(snapshot)
    if missing:
        main(mx.array(missing, dtype=mx.int32)[None])
    main.write_back()
    mx.eval([c.state for c in main.cache])


def _decision(f, ids: List[int]) -> Tuple[bool, list]:
    """Forward f's samples read on the host: whether its draft stood, and the tokens it decided (appended to ids) as
    (token, logprobs, from_draft) to yield: the draft and the sample after it, or the sample that replaces it."""
    d_id, s1_id = f.d.item(), f.s1.item()
    if s1_id == d_id:
        s2_id = f.s2.item()
        ids += [d_id, s2_id]
        return True, [(d_id, f.lp1, True), (s2_id, f.lp2, False)]
    ids.append(s1_id)
    return False, [(s1_id, f.lp1, False)]


@mx.compile
def _next_inputs(s1: mx.array, s2: mx.array, d: mx.array, offset4: mx.array):
    """A forward's fate on the GPU: accept [1] (its draft d confirmed) as bool and as the position the head drafts
    after, the head's tokens [1, 2], and the next forward's first token (s2 after a confirmed draft, else s1) and
    offset (one further after a confirmed draft)."""
    accept = s1 == d
    pick = accept.astype(mx.int32)
    return accept, pick, mx.concatenate([s1, s2])[None], mx.where(accept, s2, s1), offset4 + 1 + pick


def _resident_steps(main: CompiledVerifier, drafter: CompiledDrafter, sample: Callable, ids: List[int],
                    first_lp: mx.array, d: mx.array, max_tokens: int, n_prompt: int, prompt_cache):
    """mtp_generate_step's loop with the accept decision on the GPU (switch mtp_resident; no logits processors: they
    read the decided tokens on the host). ids: the prompt and the first sample, whose log-probabilities are first_lp;
    d: the head's draft after it."""

    def queue(token, d, offset4, accept, after, before, length) -> _Forward:
        tokens = mx.concatenate([token, d])[None]
        hidden, logits, after, before = main.selected(tokens, offset4[:1], accept, after, before, length)
        s1, lp1 = sample(logits[0, -2], None)
        s2, lp2 = sample(logits[0, -1], None)
        # d itself, not a slice of tokens: a new op's .item() would wait for everything queued before it
        mx.async_eval(d, s1, s2, lp1, lp2)
        return _Forward(d, s1, lp1, s2, lp2, hidden, kept=before, offset4=offset4, after=after)

    def queue_after(f: _Forward, offset: int) -> _Forward:
        """The forward after f, which starts at f's offset `offset` (the host's): at most 2 further."""
        accept, pick, pair, token, offset4 = _next_inputs(f.s1, f.s2, f.d, f.offset4)
        d = drafter.picked(f.hidden, pair, f.offset4[:1], pick, offset + 2)
        return queue(token, d, offset4, accept, f.after, f.kept, offset + 4)

    def needed(decided: int) -> bool:
        """Whether a forward after `decided` tokens can yield one max_tokens allows."""
        return max_tokens < 0 or decided < max_tokens

    settled = main.states, len(ids) - 1  # the decided states: every token before ids[settled[1]]
    oldest = None  # the oldest forward not yet decided
    if needed(1):
        oldest = queue(mx.array(ids[-1:], dtype=mx.int32), d, mx.full((4,), settled[1], dtype=mx.int32),
                       mx.array([True]), settled[0], settled[0], settled[1] + 2)
    ready = [(ids[-1], first_lp, False)]  # decided, not yet yielded
    yielded = 0
    try:
        while True:
            # The next forward is queued before the host waits on oldest's samples; the GPU decides where it starts.
            ahead = queue_after(oldest, settled[1]) if needed(yielded + len(ready) + 1) else None
            yielded = yield from _hand_out(ready, yielded, max_tokens)
            if yielded == max_tokens:
                return
            stood, ready = _decision(oldest, ids)
            settled = oldest.after if stood else oldest.kept, len(ids) - 1
            oldest = ahead
    finally:
        if prompt_cache is not None:
            _settle(main, settled, ids[settled[1]:n_prompt + yielded])


def mtp_generate_step(
    prompt: mx.array,
    model,
    stream=generation_stream,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    max_pending: int = MAX_PENDING,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yields (token, logprobs [V], from_draft) as mlx_lm's speculative_generate_step does: from_draft marks a draft
    the main model confirmed. The prompt [N] of token ids goes through the main model in `prefill_step_size` chunks
    and through the MTP head's cache beside it. A given prompt_cache ends holding the prompt and every yielded token,
    as after generate_step."""
    check_model(model)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"mtp: a non-empty 1-D prompt of token ids expected, got shape {prompt.shape}")
    cache = prompt_cache if prompt_cache is not None else model.make_cache()
    _check_cache(cache)
    mtp_cache = [KVCache() for _ in model.mtp.layers]
    sampler = sampler or greedy_sampler
    progress = prompt_progress_callback or (lambda *_: None)
    lm = model.language_model
    ids = prompt.tolist()  # the prompt and every decided token
    n_prompt = len(ids)

    def sample(logits: mx.array, history: Optional[mx.array]):
        """logits [V] at the last token of history (every token so far, for the processors)."""
        logits = logits[None]
        for processor in logits_processors or ():
            logits = processor(history, logits)
        token, logprobs = sample_logprobs(logits, sampler)
        return token.astype(mx.int32), logprobs.squeeze(0)

    def history(*extra: mx.array) -> Optional[mx.array]:
        return mx.concatenate([mx.array(ids, dtype=mx.int32), *extra]) if logits_processors else None

    def forward(tokens: mx.array, pending: Optional[List[int]], d: mx.array, *assumed: mx.array) -> _Forward:
        """Queues the verify forward of tokens [P] (pending ids, or the lazy sample they will be) and draft d [1];
        `assumed`: the lazy tokens decided before `tokens` that ids does not hold yet."""
        before = main.snapshot()
        hidden, logits = main(mx.concatenate([tokens, d])[None])
        kept = main.kept()
        s1, lp1 = sample(logits[0, -2], history(*assumed))
        s2, lp2 = sample(logits[0, -1], history(*assumed, d))
        mx.async_eval(d, s1, s2, lp1, lp2)
        return _Forward(d, s1, lp1, s2, lp2, hidden, before=before, kept=kept, pending=pending)

    with mx.stream(stream):
        done = 0
        progress(done, n_prompt)
        with bounded_prefill():
            while n_prompt - done > 1:
                n = min(prefill_step_size, n_prompt - done - 1)
                hidden = lm.model(prompt[None, done:done + n], cache=cache)
                model.mtp_hidden(hidden, prompt[None, done + 1:done + n + 1], mtp_cache)  # only its K/V are kept
                mx.eval([c.state for c in cache] + [c.state for c in mtp_cache])
                done += n
                progress(done, n_prompt)
                mx.clear_cache()

        main, drafter = _Eager(model, cache), _EagerDrafter(model, mtp_cache)
        hidden, logits = main(prompt[None, -1:])
        token, logprobs = sample(logits[0, -1], history())
        d = drafter(hidden, token[None])
        mx.eval(token)
        progress(n_prompt, n_prompt)
        if CompiledVerifier.applicable(model, cache):  # compiled steps per token count from here on
            # the decided tokens, the pending ones and a draft, and the 2 tokens of the forward queued ahead
            reserve = max_tokens + max_pending + 4 if max_tokens > 0 else STEP
            main, drafter = CompiledVerifier(model, cache, reserve), CompiledDrafter(model, mtp_cache, reserve)
        ids.append(token.item())
        if isinstance(main, CompiledVerifier) and ops.enabled("mtp_resident") and not logits_processors:
            yield from _resident_steps(main, drafter, sample, ids, logprobs, d, max_tokens, n_prompt, prompt_cache)
            return
        ready = [(ids[-1], logprobs, False)]  # decided, not yet yielded
        oldest = forward(mx.array(ids[-1:], dtype=mx.int32), ids[-1:], d)  # the oldest forward not yet decided
        yielded = 0
        try:
            while True:
                # The next forward is queued, as if oldest's draft stood, before the host waits on oldest's samples
                # and hands out the tokens decided before.
                drafted = drafter.snapshot()
                d = drafter(oldest.hidden, mx.concatenate([oldest.d, oldest.s2])[None])
                ahead = forward(oldest.s2, None, d, oldest.d, oldest.s2)
                yielded = yield from _hand_out(ready, yielded, max_tokens)
                if yielded == max_tokens:
                    return
                stood, ready = _decision(oldest, ids)
                if stood:
                    oldest = ahead._replace(pending=ids[-1:])
                else:  # both forwards and the draft after oldest are undone
                    drafter.restore(drafted)
                    s1_id = ids[-1]
                    d = drafter(oldest.hidden[:, :1], oldest.s1[None])
                    if oldest.kept is not None:  # back to just before the rejected draft: its other tokens stand
                        main.restore(oldest.kept)
                        pending = [s1_id]
                    else:  # back to before the forward: its pending tokens go again
                        main.restore(oldest.before)
                        pending = oldest.pending + [s1_id]
                    if len(pending) > max_pending:
                        main(mx.array(pending[:-1], dtype=mx.int32)[None])
                        pending = pending[-1:]
                    oldest = forward(mx.array(pending, dtype=mx.int32), pending, d)
        finally:
            if prompt_cache is not None:  # it holds all but oldest's pending tokens
                _settle(main, oldest.before, ids[len(ids) - len(oldest.pending):n_prompt + yielded])
