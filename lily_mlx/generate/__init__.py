"""`lily-mlx generate` / `python -m lily_mlx.generate`: mlx_lm.generate's CLI on lily_mlx.

Importing this module also gives mlx_lm.generate's Python names (generate_step, stream_generate, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import load_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..generation import *  # noqa: F401,F403  (the drop-in names, as mlx_lm.generate has them)
from ..generation import generate

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lily-mlx generate", description="Generate text (flags follow mlx_lm.generate).")
    p.add_argument("--model", type=str, default="embedded", help="model folder, hub repo, 'embedded' (default, bf16) or 'embedded-4bit'")
    p.add_argument("--revision", type=str, default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--extra-eos-token", type=str, default=(), nargs="+", help="extra end-of-sequence tokens")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="message for the model ('-' reads stdin)")
    p.add_argument("--prefill-response", default=None, help="start of the assistant's response")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, help="maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k")
    p.add_argument("--min-tokens-to-keep", type=int, default=1, help="minimum tokens kept by min-p")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--chat-template-config", default=None, help='JSON kwargs for the chat template, e.g. {"enable_thinking": false}')
    p.add_argument("--verbose", type=lambda s: s.lower() not in ("false", "0", "no"), default=True, help="print timing")
    p.add_argument("--max-kv-size", type=int, default=None, help="attention KV window (DeltaNet state is unbounded)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    p.add_argument("--prompt-cache-file", type=str, default=None, help="a prompt cache saved by cache_prompt")
    p.add_argument("--kv-bits", type=int, default=None, help="quantize the KV cache to this many bits")
    p.add_argument("--kv-group-size", type=int, default=64, help="KV cache quantization group size")
    p.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START, help="step to start KV quantization")
    p.add_argument("--mtp", action="store_true", help="speculative decoding with the checkpoint's own MTP head")
    return p


class UsageError(ValueError):
    """A bad CLI argument: printed as one line, exit status 2."""


def run(args: argparse.Namespace) -> str:
    from ..loading import load

    if args.max_tokens < -1 or args.max_tokens == 0:
        raise UsageError(f"--max-tokens must be positive (or -1 for no limit), got {args.max_tokens}")
    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt_cache, metadata = None, {}
    if args.prompt_cache_file is not None:
        prompt_cache, metadata = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
        if args.model == "embedded" and metadata.get("model"):
            args.model = metadata["model"]
    tokenizer_config = json.loads(metadata["tokenizer_config"]) if "tokenizer_config" in metadata else {}
    model, tokenizer = load(args.model, tokenizer_config=tokenizer_config, revision=args.revision)
    if args.mtp:
        from ..speculative import check_model

        try:
            check_model(model)
        except ValueError as e:
            raise UsageError(str(e)) from None
        for flag, value in (("--max-kv-size", args.max_kv_size), ("--kv-bits", args.kv_bits)):
            if value is not None:
                raise UsageError(f"--mtp: {flag} is not supported with MTP speculative decoding")
    for eos in args.extra_eos_token:
        tokenizer.add_eos_token(eos)
    template_kwargs = {}
    if args.chat_template_config is not None:
        try:
            template_kwargs = json.loads(args.chat_template_config)
        except json.JSONDecodeError as e:
            raise UsageError(f"--chat-template-config is not valid JSON ({e})") from None
        if not isinstance(template_kwargs, dict):
            raise UsageError("--chat-template-config must be a JSON object")

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    if not prompt.strip() and args.prefill_response is None:
        raise UsageError("the prompt is empty")
    use_chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prefill = args.prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=prefill, add_generation_prompt=not prefill, **template_kwargs
        )
        if prompt_cache is not None:  # the cached prefix already holds the conversation up to the query
            messages[-1]["content"] = "<query>"
            probe = tokenizer.apply_chat_template(
                messages, tokenize=False, continue_final_message=prefill, add_generation_prompt=not prefill, **template_kwargs
            )
            prompt = prompt[probe.index("<query>"):]
    ids = tokenizer.encode(prompt, add_special_tokens=not use_chat)
    context = model.config.max_position_embeddings if hasattr(model, "config") else None
    cached = prompt_cache[0].size() if prompt_cache is not None and hasattr(prompt_cache[0], "size") else 0
    if context is not None and cached + len(ids) > context:
        raise UsageError(f"the prompt has {cached + len(ids)} tokens, over the model's context of {context}")
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k)
    response = generate(
        model, tokenizer, ids, max_tokens=args.max_tokens, verbose=args.verbose, sampler=sampler,
        max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size, prompt_cache=prompt_cache,
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
        mtp=args.mtp,
    )
    if not args.verbose:
        print(response)
    return response


def main(argv: Optional[List[str]] = None) -> int:
    from ..config import ConfigError
    from ..loading import CheckpointError

    args = setup_arg_parser().parse_args(argv)
    try:
        run(args)
    except (UsageError, FileNotFoundError, ConfigError, CheckpointError, NotImplementedError) as e:
        print(f"lily-mlx generate: error: {e}", file=sys.stderr)
        return 2
    return 0
