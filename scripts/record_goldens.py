"""Record the embedded model's greedy goldens from stock mlx-lm into tests/embedded_goldens.json.

    python scripts/record_goldens.py

For each prompt and each shipped layout: the prompt's token ids and the 64 tokens stock mlx-lm's
`generate_step` picks greedily (argmax; eos does not stop it, so every golden has 64 tokens), on CPU, with
the checkpoint's float tensors cast to float32 after loading (`model.set_dtype`; the 4-bit codes stay as
they are, and stock's sanitize has already added 1 to the HF layout's zero-centred norm weights in bf16,
as lily_mlx's does). Why float32:
- hf-bf16: stock mlx-lm cannot run it in bf16 on CPU: MLX's CPU GatherMM takes float32 only (the error is
  recorded in the file as `stock_bf16_on_cpu`).
- mlx-4bit: stock runs it in bf16, but this model's bf16 logits have exact top-2 ties within 64 greedy steps
  (recorded per prompt as `bf16_min_margin` and `bf16_first_divergence` from the float32 run), where two
  correct engines whose bf16 roundings differ by one unit pick different tokens.
tests/test_embedded.py asserts that lily_mlx (float32 the same way) reproduces these tokens, that stock
mlx-lm still does, and that lily_mlx in bf16 follows them up to bf16 resolution.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "embedded_goldens.json"
ASSETS = ROOT / "lily_mlx" / "assets"
LAYOUTS = {"hf-bf16": ASSETS / "lily-tiny", "mlx-4bit": ASSETS / "lily-tiny-4bit"}
MAX_TOKENS = 64
PROMPTS = [
    {"name": "code", "text": "def fibonacci("},
    {"name": "docstring", "text": "Return a new list"},
    {"name": "chat", "messages": [{"role": "user", "content": "What does json.dumps do?"}],
     "chat_template_kwargs": {"enable_thinking": False}},
]


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    if "messages" in prompt:
        return list(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True,
                                                  **prompt["chat_template_kwargs"]))
    return tokenizer.encode(prompt["text"], add_special_tokens=False)


def load_stock(layout: str, float32: bool = True):
    """Stock mlx-lm's model and tokenizer for a layout, cast to float32 as the goldens are recorded."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(LAYOUTS[layout]))
    if float32:
        model.set_dtype(mx.float32)
    return model, tokenizer


def greedy(model, ids: list[int]) -> tuple[list[int], float]:
    """MAX_TOKENS argmax tokens from stock mlx-lm's generate_step, and the smallest top-1 minus top-2
    log-probability gap met on the way (how close the run came to a tie)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, margin = [], float("inf")
    for token, logprobs in generate_step(mx.array(ids), model, max_tokens=MAX_TOKENS):
        top2 = mx.sort(logprobs.astype(mx.float32))[-2:]
        margin = min(margin, (top2[1] - top2[0]).item())
        tokens.append(int(token))
    return tokens, margin


def bf16_error() -> str:
    """What stock mlx-lm says when asked to run the bf16 checkpoint as it is on CPU ('' if it can)."""
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(LAYOUTS["hf-bf16"]))
    try:
        mx.eval(model(mx.array([[1, 2, 3]])))
    except Exception as e:  # MLX raises a plain RuntimeError/ValueError for unsupported dtypes
        return f"{type(e).__name__}: {e}"
    return ""


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    mx.set_default_device(mx.cpu)
    record = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "max_tokens": MAX_TOKENS,
              "stock_bf16_on_cpu": bf16_error() or "runs", "prompts": PROMPTS, "goldens": {}}
    for layout in LAYOUTS:
        model, tokenizer = load_stock(layout)
        record["goldens"][layout] = {}
        for p in PROMPTS:
            ids = prompt_ids(tokenizer, p)
            tokens, margin = greedy(model, ids)
            golden = {"prompt_ids": ids, "tokens": tokens, "min_margin": round(margin, 4), "text": tokenizer.decode(tokens)}
            if layout == "mlx-4bit":  # what a native bf16 run of stock mlx-lm does with the same prompt
                native, native_margin = greedy(load_stock(layout, float32=False)[0], ids)
                golden["bf16_min_margin"] = round(native_margin, 4)
                golden["bf16_first_divergence"] = next((i for i, (a, b) in enumerate(zip(native, tokens)) if a != b), None)
            record["goldens"][layout][p["name"]] = golden
            print(f"{layout} {p['name']}: {golden}")
    text = json.dumps(record, indent=1)
    text = re.sub(r"\[[\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text)  # id lists on one line
    OUT.write_text(text + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
