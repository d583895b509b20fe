"""Drop-in for mlx_lm.generate: the same functions, signatures, defaults and return types.

Our loop drives any mlx-lm model and mlx-lm's loop drives ours, so an A/B can swap either alone.
The loop: prompt prefill in `prefill_step_size` chunks, then decode with the next step queued on the
GPU (async_eval) before the current token is handed to the host; the only host sync per token is
the token id. For lily_mlx models the decode step is one compiled function over fixed shapes
(see `lily_mlx.decode`), so the Python graph-building cost is paid once, not per token.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    BatchGenerator,
    BatchResponse,
    GenerationResponse,
    generation_stream,
    maybe_quantize_kv_cache,
    wired_limit,
)
from mlx_lm.generate import batch_generate as _mlx_batch_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import ops
from .decode import STEP, CompiledDecoder
from .memory import bounded_prefill

__all__ = [
    "BatchGenerator", "BatchResponse", "GenerationResponse", "batch_generate", "generate",
    "generate_step", "make_cache", "stream_generate",
]


def make_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    """The model's cache; unlike mlx-lm's make_prompt_cache, `max_kv_size` is honoured by lily models."""
    from .model import Model

    if isinstance(model, Model):
        return model.make_cache(max_kv_size=max_kv_size)
    return make_prompt_cache(model, max_kv_size=max_kv_size)


def sample_logprobs(logits: mx.array, sampler: Sampler) -> Tuple[mx.array, mx.array]:
    """logits [..., V] -> (the sampler's token, logprobs [..., V]) as generate_step takes them: the greedy sampler's
    token comes from the logprobs' own launch (ops.to_logprobs)."""
    logprobs, greedy = ops.to_logprobs(logits, greedy=sampler is greedy_sampler)
    return greedy if greedy is not None else sampler(logprobs), logprobs


def _check_max_tokens(max_tokens) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:
        raise ValueError(f"max_tokens must be a non-negative integer (or -1 for no limit), got {max_tokens!r}")


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream=generation_stream,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    input_embeddings: Optional[mx.array] = None,
    mtp: bool = False,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yields (token, logprobs [V]) pairs, exactly as mlx_lm.generate.generate_step does. mtp: speculative decoding
    with the checkpoint's multi-token-prediction head (lily_mlx.speculative); the same tokens, fewer forwards."""
    _check_max_tokens(max_tokens)
    if not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be a positive integer, got {prefill_step_size!r}")
    if mtp:
        steps = _mtp_steps(prompt, model, stream, max_tokens=max_tokens, sampler=sampler,
                           logits_processors=logits_processors, max_kv_size=max_kv_size, prompt_cache=prompt_cache,
                           prefill_step_size=prefill_step_size, kv_bits=kv_bits,
                           prompt_progress_callback=prompt_progress_callback, input_embeddings=input_embeddings)
        yield from ((token, logprobs) for token, logprobs, _ in steps)
        return
    n_prompt = len(input_embeddings) if input_embeddings is not None else len(prompt)
    if input_embeddings is not None and len(prompt) > 0 and len(prompt) != len(input_embeddings):
        raise ValueError(
            f"input_embeddings have {len(input_embeddings)} positions but the prompt has {len(prompt)} tokens"
        )
    if n_prompt == 0:
        raise ValueError("the prompt is empty: give at least one token (or input_embeddings)")

    cache = prompt_cache if prompt_cache is not None else make_cache(model, max_kv_size)
    sampler = sampler or greedy_sampler
    progress = prompt_progress_callback or (lambda *_: None)
    quantize_cache = functools.partial(
        maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start, kv_group_size=kv_group_size, kv_bits=kv_bits
    )
    history = None  # tokens seen so far, only kept when logits processors need them

    decoder = None  # set once the prompt is in the cache, when the compiled decode step applies

    def forward(tokens, embeddings):
        if decoder is not None:
            return decoder(tokens[None])[:, None, :]
        if embeddings is not None:
            return model(tokens[None], cache=cache, input_embeddings=embeddings[None])
        return model(tokens[None], cache=cache)

    def step(tokens, embeddings=None):
        nonlocal history
        with mx.stream(stream):
            logits = forward(tokens, embeddings)[:, -1, :]
            if logits_processors and len(tokens) > 0:
                history = tokens if history is None else mx.concat([history, tokens])
                for processor in logits_processors:
                    logits = processor(history, logits)
            quantize_cache(cache)
            token, logprobs = sample_logprobs(logits, sampler)
            return token, logprobs.squeeze(0)

    with mx.stream(stream):
        done = 0
        progress(done, n_prompt)
        with bounded_prefill():  # not across the yields below: the caller's code runs between them
            while n_prompt - done > 1:
                n = min(prefill_step_size, n_prompt - done - 1)
                chunk_embeddings = input_embeddings[:n] if input_embeddings is not None else None
                forward(prompt[:n], chunk_embeddings)
                quantize_cache(cache)
                mx.eval([c.state for c in cache])
                if logits_processors and n > 0:
                    history = prompt[:n] if history is None else mx.concat([history, prompt[:n]])
                done += n
                progress(done, n_prompt)
                prompt = prompt[n:]
                if input_embeddings is not None:
                    input_embeddings = input_embeddings[n:]
                mx.clear_cache()

        y, logprobs = step(prompt, input_embeddings)
        if prompt.ndim == 1 and kv_bits is None and CompiledDecoder.applicable(model, cache):
            decoder = CompiledDecoder(model, cache, reserve=max_tokens + 1 if max_tokens > 0 else STEP)
        mx.async_eval(y, logprobs)
        n = 0
        try:
            while True:
                if n != max_tokens:
                    next_y, next_logprobs = step(y)
                    mx.async_eval(next_y, next_logprobs)
                if n == 0:
                    mx.eval(y)
                    progress(n_prompt, n_prompt)
                if n == max_tokens:
                    break
                yield y.item(), logprobs
                if n % 256 == 0:
                    mx.clear_cache()
                y, logprobs = next_y, next_logprobs
                n += 1
        finally:
            if decoder is not None:  # the caller's prompt_cache continues from where decoding stopped
                decoder.write_back()


def _mtp_steps(prompt, model, stream, *, max_tokens: int = 256, max_kv_size=None, kv_bits=None, input_embeddings=None,
               kv_group_size: int = 64, quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START, **kwargs):
    """mtp_generate_step with generate_step's arguments, refusing those it cannot roll back or draft from."""
    from .speculative import mtp_generate_step

    for name, value in (("max_kv_size", max_kv_size), ("kv_bits", kv_bits), ("input_embeddings", input_embeddings)):
        if value is not None:
            raise ValueError(f"mtp: {name} is not supported with MTP speculative decoding")
    return mtp_generate_step(prompt, model, stream, max_tokens=max_tokens, **kwargs)


def _encode(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    stream=generation_stream,
    mtp: bool = False,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Yields GenerationResponse objects, with mlx_lm.stream_generate's fields and timing semantics. mtp: speculative
    decoding with the checkpoint's own MTP head; from_draft marks the drafted tokens the model confirmed."""
    if draft_model is not None:
        raise NotImplementedError(
            "draft_model: speculative decoding with a separate draft model is not supported by lily_mlx (mtp=True "
            "drafts with the checkpoint's own MTP head; or use mlx_lm.stream_generate)"
        )
    kwargs.pop("num_draft_tokens", None)
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    _check_max_tokens(max_tokens)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode(tokenizer, prompt)
    detokenizer = tokenizer.detokenizer
    if mtp:
        tokens = _mtp_steps(prompt, model, stream, max_tokens=max_tokens, **kwargs)
    else:
        tokens = ((token, logprobs, False) for token, logprobs in
                  generate_step(prompt, model, stream, max_tokens=max_tokens, **kwargs))
    with wired_limit(model, [stream]):
        tic = time.perf_counter()
        for n, (token, logprobs, from_draft) in enumerate(tokens):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if (n + 1) == max_tokens:
                break
            yield GenerationResponse(
                text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
                prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
                generation_tps=(n + 1) / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None,
            )
        detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
        )


def generate(model: nn.Module, tokenizer, prompt: Union[str, List[int]], verbose: bool = False, **kwargs) -> str:
    """The whole response as a string; with verbose, prints it and the timing lines mlx-lm prints."""
    if verbose:
        print("=" * 10)
    text = ""
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def batch_generate(
    model,
    tokenizer,
    prompts: List[List[int]],
    prompt_caches: Optional[List[List[Any]]] = None,
    max_tokens: Union[int, List[int]] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    **kwargs,
) -> BatchResponse:
    """mlx-lm's batch_generate (its BatchGenerator drives our model: left padding, masks, batched caches)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batch_generate needs a non-empty list of non-empty token-id prompts")
    for m in [max_tokens] if isinstance(max_tokens, int) else max_tokens:
        _check_max_tokens(m)
    return _mlx_batch_generate(
        model, tokenizer, prompts, prompt_caches=prompt_caches, max_tokens=max_tokens, verbose=verbose,
        return_prompt_caches=return_prompt_caches, return_token_ids=return_token_ids,
        return_logprobs=return_logprobs, **kwargs,
    )
