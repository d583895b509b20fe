"""Teacher-forced perplexity of either engine on the same checkpoint, as mlx_lm.perplexity computes it.

    lily-mlx perplexity --model M --text corpus.txt --context-length 512 --compare
    lily-mlx perplexity --model random:tiny --tokens ids.npy --engine stock

Windows of --context-length inputs start every --stride tokens (default: the context length, so windows
do not overlap); each window scores only the targets no earlier window scored, so every token after the
first is scored exactly once, with as much context as the window gives it. Windows of equal length are
run --batch-size at a time. --compare runs both engines (one after the other, one model in memory) and
reports each PPL, their relative difference and the largest per-token log-probability difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from . import arm, random_model


class PerplexityError(ValueError):
    pass


def read_tokens(path: Path, vocab: int, tokenizer=None) -> np.ndarray:
    """Token ids from .npy, a .json list, whitespace-separated integers, or (with a tokenizer) plain text."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if tokenizer is not None:
        ids = np.array(tokenizer.encode(path.read_text()), dtype=np.int64)
    elif path.suffix == ".npy":
        ids = np.load(path)
    elif path.suffix == ".json":
        ids = np.array(json.loads(path.read_text()))
    else:
        try:
            ids = np.array([int(t) for t in path.read_text().split()])
        except ValueError as e:
            raise PerplexityError(f"{path}: a token file holds integers ({e}); use --text for plain text") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise PerplexityError(f"{path}: expected a flat list of integer token ids, got shape {ids.shape} of {ids.dtype}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise PerplexityError(f"{path}: token {int(ids[bad[0]])} at position {int(bad[0])} is outside the vocabulary [0, {vocab})")
    if ids.size < 2:
        raise PerplexityError(f"{path}: {ids.size} tokens; perplexity needs at least 2")
    return ids.astype(np.int32)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) over tokens[start:end]: inputs [start, end-1), targets (start, end)."""
    if context < 1 or not 1 <= stride <= context:
        raise PerplexityError(f"--context-length {context} / --stride {stride}: need 1 <= stride <= context length")
    out, scored, start = [], 1, 0
    while scored < n:
        end = min(start + context + 1, n)
        if end - 1 >= scored:
            out.append((start, end, scored))
            scored = end
        start += stride
    return out


def token_logprobs(model, ids: np.ndarray, context: int, stride: int, batch_size: int, progress=None) -> np.ndarray:
    """log p(token t | tokens before t, within its window) for t = 1 .. n-1, float32."""
    import mlx.core as mx
    from tqdm import tqdm

    wins = windows(len(ids), context, stride)
    out = np.full(len(ids) - 1, np.nan, dtype=np.float32)
    groups: dict[int, list] = {}
    for w in wins:
        groups.setdefault(w[1] - w[0], []).append(w)
    batches = [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    for batch in tqdm(batches, desc="perplexity", unit="batch", disable=None if progress is None else not progress, leave=False):
        x = mx.array(np.stack([ids[s:e] for s, e, _ in batch]))  # [B, L+1]
        logits = model(x[:, :-1]).astype(mx.float32)  # [B, L, V]
        lp = mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)
        lp = np.array(lp)
        for row, (s, e, first) in zip(lp, batch):
            out[first - 1:e - 1] = row[first - s - 1:]
    if np.isnan(out).any():
        raise AssertionError("some targets were not scored")
    return out


def load_engine(engine: str, path: str, dtype: Optional[str] = None):
    return arm.load(engine, path, dtype)[0]


def summary(lp: np.ndarray, seconds: float) -> dict:
    nll = -lp.astype(np.float64)
    ppl = math.exp(nll.mean())
    se = ppl * nll.std(ddof=1) / math.sqrt(nll.size) if nll.size > 1 else float("nan")
    return {"ppl": ppl, "ppl_standard_error": se, "mean_nll": float(nll.mean()), "tokens": int(nll.size),
            "seconds": seconds, "tokens_per_s": nll.size / seconds if seconds > 0 else None}


def evaluate(model_path: Path, ids: np.ndarray, engines: list[str], context: int, stride: int, batch_size: int, progress=None,
             dtype: Optional[str] = None) -> dict:
    import mlx.core as mx

    results, lps = {}, {}
    for engine in engines:
        model = load_engine(engine, str(model_path), dtype)
        t0 = time.perf_counter()
        lps[engine] = token_logprobs(model, ids, context, stride, batch_size, progress)
        results[engine] = summary(lps[engine], time.perf_counter() - t0)
        results[engine]["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        del model
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
    report = {"model": str(model_path), "context_length": context, "stride": stride, "batch_size": batch_size,
              "dtype": dtype, "engines": results}
    if len(engines) == 2:
        a, b = engines
        diff = np.abs(lps[a].astype(np.float64) - lps[b])
        worst = int(diff.argmax())
        report["compare"] = {
            "ppl_rel_diff": abs(results[b]["ppl"] - results[a]["ppl"]) / results[a]["ppl"],
            "max_abs_logprob_diff": float(diff[worst]),
            "mean_abs_logprob_diff": float(diff.mean()),
            "worst_position": worst + 1,
            "worst_token": int(ids[worst + 1]),
            "worst_logprobs": {a: float(lps[a][worst]), b: float(lps[b][worst])},
        }
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="lily-mlx perplexity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model folder, hub repo, or random:<shape>")
    ap.add_argument("--model-dir", help="folder where a random model is built or reused")
    ap.add_argument("--seed", type=int, default=0, help="weights seed of a random model")
    ap.add_argument("--random-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of a random model's scales, biases and norms")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a text file, tokenized with the model's tokenizer")
    src.add_argument("--tokens", help="token ids: .npy, a .json list, or whitespace-separated integers")
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--stride", type=int, help="window step (default: the context length)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, help="use only the first N tokens")
    eng = ap.add_mutually_exclusive_group()
    eng.add_argument("--engine", choices=("lily", "stock"), default="lily")
    eng.add_argument("--compare", action="store_true", help="run stock then lily and compare")
    ap.add_argument("--dtype", choices=arm.DTYPES, help="cast both engines' floating parameters after loading")
    ap.add_argument("--json", dest="json_path", help="write the report here")
    args = ap.parse_args(argv)
    try:
        if args.batch_size < 1:
            raise PerplexityError(f"--batch-size {args.batch_size} must be >= 1")
        if args.model.startswith("random:"):
            path = random_model.ensure(args.model, args.model_dir, seed=args.seed, dtype=args.random_dtype)
        else:
            from lily_mlx.loading import resolve_model_path

            path = resolve_model_path(args.model)
        raw = json.loads((path / "config.json").read_text())
        vocab = raw.get("text_config", raw)["vocab_size"]
        tokenizer = None
        if args.text:
            from mlx_lm.utils import load_tokenizer

            tokenizer = load_tokenizer(path)
        ids = read_tokens(Path(args.text or args.tokens), vocab, tokenizer)
        if args.max_tokens:
            ids = ids[: args.max_tokens]
        engines = ["stock", "lily"] if args.compare else [args.engine]
        report = evaluate(path, ids, engines, args.context_length, args.stride or args.context_length, args.batch_size,
                          dtype=args.dtype)
    except (PerplexityError, random_model.SpecError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for engine, r in report["engines"].items():
        print(f"{engine}: perplexity {r['ppl']:.4f} ± {r['ppl_standard_error']:.4f} over {r['tokens']} tokens "
              f"({r['tokens_per_s']:.0f} tok/s, peak {r['peak_memory_gb']:.2f} GB)")
    if "compare" in report:
        c = report["compare"]
        print(f"relative PPL difference {100 * c['ppl_rel_diff']:.4f}%; largest per-token log-prob difference "
              f"{c['max_abs_logprob_diff']:.3g} (position {c['worst_position']}, token {c['worst_token']}); "
              f"mean {c['mean_abs_logprob_diff']:.3g}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
