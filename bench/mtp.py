"""MTP speculative decoding end to end against plain greedy decoding, at a set acceptance.

A random model's MTP head is untrained, so its drafts are noise. After the head has drafted (its real cost), the
bench replaces each draft with the plain decoder's own next token with probability ACCEPT, else with a token the
model rejects: the acceptance is set, the cost is the real one. `--accept real` keeps the head's own drafts (a real
checkpoint). Each run's tokens must equal plain greedy decoding's; a run that differs is reported, not timed.
Decode throughput is generation_tps's: tokens after the first over the time since the first. "forwards a token" counts
the compiled verify forwards (those queued ahead and undone too) over the tokens generated, "forwards by tokens" how
many took each token count (a rejected forward's tokens go again with the next).

    python -m bench.mtp --model PATH [--prompt-tokens 64] [--tokens 128] [--accept 0 0.5 0.8 1 real] [--rounds 3]
        [--with verify_keep mtp_resident] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


@contextlib.contextmanager
def set_acceptance(sequence: list[int], accept: float, vocab: int, seed: int = 0):
    """Every MTP draft (the compiled head's, and the eager head's first after the prompt), once the head has run,
    replaced by sequence's token at its position with probability `accept`, else by another token."""
    from lily_mlx.decode import CompiledDrafter
    from lily_mlx.speculative import _EagerDrafter

    rng = random.Random(seed)
    # the head at position t drafts token t + 2, and its cache holds positions up to t + 1 after the call
    drafters = {CompiledDrafter: lambda d: d.offset, _EagerDrafter: lambda d: d.cache[0].offset}
    real = {cls: cls.__call__ for cls in drafters}

    def patched(cls):
        def draft(self, hidden, next_tokens):
            out = real[cls](self, hidden, next_tokens)
            i = drafters[cls](self) + 1
            want = sequence[i] if i < len(sequence) else 0
            return out * 0 + (want if rng.random() < accept else (want + 1) % vocab)  # out * 0: the head still runs
        return draft

    # switch mtp_resident: the position is on the GPU (the head at offset1 + pick1 drafts the token 2 after it)
    padded = mx.array(sequence + [0, 0, 0], dtype=mx.int32)
    real_picked = CompiledDrafter.picked

    def picked(self, hidden, next_tokens, offset1, pick1, length):
        out = real_picked(self, hidden, next_tokens, offset1, pick1, length)
        want = mx.take(padded, mx.minimum(offset1 + pick1 + 2, padded.size - 1))
        return out * 0 + (want if rng.random() < accept else (want + 1) % vocab)

    for cls in drafters:
        cls.__call__ = patched(cls)
    CompiledDrafter.picked = picked
    try:
        yield
    finally:
        for cls, call in real.items():
            cls.__call__ = call
        CompiledDrafter.picked = real_picked


@contextlib.contextmanager
def counted_forwards(calls: list):
    """Every compiled verify forward appended to calls: the ones queued ahead and undone count too."""
    from lily_mlx.decode import CompiledVerifier

    real, real_selected = CompiledVerifier.__call__, CompiledVerifier.selected
    CompiledVerifier.__call__ = lambda self, tokens: calls.append(tokens.shape[1]) or real(self, tokens)
    CompiledVerifier.selected = lambda self, tokens, *a: calls.append(tokens.shape[1]) or \
        real_selected(self, tokens, *a)
    try:
        yield
    finally:
        CompiledVerifier.__call__, CompiledVerifier.selected = real, real_selected


def timed(steps) -> tuple[list[int], list[bool], float]:
    """(tokens, from_draft flags, decode tok/s) of a generate_step-like iterator of (token, logprobs[, from_draft])."""
    tokens, drafts, t0 = [], [], None
    for item in steps:
        tokens.append(item[0])
        drafts.append(bool(item[2]) if len(item) > 2 else False)
        if t0 is None:
            t0 = time.perf_counter()
    mx.synchronize()
    return tokens, drafts, (len(tokens) - 1) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.generation import generate_step
    from lily_mlx.speculative import check_model, mtp_generate_step

    ap = argparse.ArgumentParser(prog="python -m bench.mtp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated a run")
    ap.add_argument("--accept", nargs="+", default=["0", "0.5", "0.8", "1"],
                    help="acceptances to set (0 to 1), or 'real' for the head's own drafts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument("--with", dest="variants", nargs="*", default=[], metavar="SWITCHES",
                    help="each acceptance also with these switches on (comma-separated names a variant), in the same "
                         "process and rounds")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    model, _ = lily_mlx.load(args.model)
    try:
        check_model(model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab = model.config.vocab_size
    prompt = mx.array(np.random.default_rng(0).integers(0, vocab, args.prompt_tokens))
    plain_tokens = timed(generate_step(prompt, model, max_tokens=args.tokens))[0]  # also the warm-up
    sequence = prompt.tolist() + plain_tokens
    variants = [()] + [tuple(filter(None, v.split(","))) for v in args.variants]  # the switches each turns on
    arms = ["plain"] + [(a, v) for a in args.accept for v in variants]
    runs: dict[str, list] = {arm: [] for arm in arms}
    forwards: dict[str, list] = {arm: [] for arm in arms}  # verify forwards a generated token
    sizes: dict[str, collections.Counter] = {arm: collections.Counter() for arm in arms}  # tokens a verify forward
    for r in range(args.rounds + 1):  # round 0 traces every token count: untimed
        for arm in arms:
            calls: list = []
            if arm == "plain":
                steps = generate_step(prompt, model, max_tokens=args.tokens)
                result = timed(steps)
            else:
                accept, switches = arm
                acceptance = set_acceptance(sequence, float(accept), vocab, seed=r) if accept != "real" else \
                    contextlib.nullcontext()
                with acceptance, counted_forwards(calls), ops.switched(switches, True):
                    result = timed(mtp_generate_step(prompt, model, max_tokens=args.tokens))
            if r:
                runs[arm].append(result)
                forwards[arm].append(len(calls) / args.tokens if arm != "plain" else 1.0)
                sizes[arm].update(calls)
    report = {"model": args.model, "mlx": mx.__version__, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "rounds": args.rounds, "rows": []}
    plain_tps = statistics.median(tps for _, _, tps in runs["plain"])
    for arm in arms:
        same = all(tokens == plain_tokens for tokens, _, _ in runs[arm])
        tps = statistics.median(tps for _, _, tps in runs[arm])
        share = statistics.mean(sum(d) / len(d) for _, d, _ in runs[arm])
        per_token = statistics.mean(forwards[arm])
        accept, switches = ("plain", ()) if arm == "plain" else arm
        row = {"arm": accept, "switches": ",".join(switches), "same_tokens": same, "tok_s": tps if same else None,
               "draft_share": share,
               "forwards_per_token": per_token, "vs_plain": tps / plain_tps if same else None,
               "forward_tokens": dict(sorted(sizes[arm].items())), "rounds_tok_s": [t for _, _, t in runs[arm]]}
        report["rows"].append(row)
        label = "plain greedy" if arm == "plain" else ", ".join((f"MTP, acceptance {accept}", *switches))
        if same:
            mix = ", ".join(f"{n} x {t}" for t, n in sorted(sizes[arm].items()))
            print(f"{label:44} {tps:8.1f} tok/s  x{tps / plain_tps:.2f}  drafts {share:.2f} of the tokens, "
                  f"{per_token:.2f} forwards a token" + (f" (forwards by tokens: {mix})" if mix else ""), flush=True)
        else:
            print(f"{label:44} FAILED: its tokens differ from plain greedy decoding's", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0 if all(r["same_tokens"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
