"""The embedded default model (lily_mlx/assets/lily-tiny): the alias resolves, lily_mlx, stock mlx-lm and
transformers give the same logits, the tokenizer and chat template work, and the weights are trained."""

import json
import re

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import torch

import lily_mlx
from lily_mlx.embedded import EMBEDDED_MODEL, resolve_embedded
from lily_mlx.loading import resolve_model_path

SENTENCE = "Return a new list containing all items from the iterable in ascending order."
STATS = json.loads((EMBEDDED_MODEL / "training.json").read_text())


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


def corpus_docs() -> list[str]:
    lines = (EMBEDDED_MODEL.parent / "corpus" / "stdlib_docstrings.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["doc"] for line in lines]


def heldout_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the held-out docstrings, rendered as the training script does."""
    ids = []
    for doc in corpus_docs()[:: STATS["val_every"]]:
        ids += tokenizer.encode(doc + "<|endoftext|>")
        if len(ids) >= n:
            return ids[:n]
    raise AssertionError(f"the held-out split has fewer than {n} tokens")


def mean_nll(model, ids) -> float:
    logits = model(mx.array([ids[:-1]])).astype(mx.float32)[0]  # [T, V]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1).mean().item()


@pytest.fixture(scope="module")
def ours():
    return lily_mlx.load("embedded")


@pytest.fixture(scope="module")
def stock():
    return mlx_lm.load(str(EMBEDDED_MODEL))


def test_alias_resolves_to_shipped_checkpoint():
    assert resolve_model_path("embedded") == EMBEDDED_MODEL
    assert resolve_embedded(None) == EMBEDDED_MODEL
    assert resolve_embedded("Qwen/Qwen3.6-35B-A3B") == "Qwen/Qwen3.6-35B-A3B"
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["layer_types"].count("full_attention") == 1
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size <= 8_000_000, f"{EMBEDDED_MODEL} holds {size} bytes; the package budget is 8 MB"


def test_logits_match_stock_mlx_lm_and_transformers(ours, stock):
    from transformers import Qwen3_5MoeForConditionalGeneration

    ids = ours[1].encode(SENTENCE)
    assert ids == stock[1].encode(SENTENCE)
    a = np.array(ours[0](mx.array([ids])))  # [1, T, V], float32 checkpoint
    b = np.array(stock[0](mx.array([ids])))
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(EMBEDDED_MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        c = hf(input_ids=torch.tensor([ids])).logits.numpy()
    assert rel(a, b) <= 1e-4
    assert rel(a, c) <= 1e-4
    assert (a.argmax(-1) == c.argmax(-1)).all()


def test_tokenizer_round_trips(ours):
    tok = ours[1]
    assert len(tok._tokenizer) == 2048
    for text in [SENTENCE, "def f(x):\n    return {'a': [1, 2]}  # ok\n", "naïve café — 東京 ✓", "  two  spaces\t\n"]:
        assert tok.decode(tok.encode(text)) == text
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]:
        assert len(tok.encode(special)) == 1, special
    assert tok.eos_token == "<|im_end|>"
    assert set(tok.eos_token_ids) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}


def test_chat_template_enable_thinking(ours):
    tok = ours[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does sorted do?"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does sorted do?<|im_end|>\n"
    thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    plain = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert thinking == head + "<|im_start|>assistant\n"
    assert plain == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    history = messages + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nIt sorts."},
                          {"role": "user", "content": "Thanks."}]
    rendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=False)
    assert "<|im_start|>assistant\nIt sorts.<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n" in rendered
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_greedy_generation_is_text(ours, stock):
    prompt = "The default encoding"
    texts = [mlx_lm.generate(m, tok, prompt, max_tokens=20, verbose=False) for m, tok in (ours, stock)]
    assert texts[0] == texts[1]
    assert len(set(ours[1].encode(texts[0]))) >= 8 and "\ufffd" not in texts[0], texts[0]
    # Trained means it writes the corpus's words, not random fragments of the BPE vocabulary.
    words = re.findall(r"[A-Za-z]+", texts[0])
    known = {w for doc in corpus_docs() for w in re.findall(r"[A-Za-z]+", doc)}
    assert len(words) >= 5 and sum(w in known for w in words) >= 0.8 * len(words), texts[0]


def test_trained_heldout_nll(ours, stock):
    ids = heldout_ids(ours[1], 1024)
    nll = mean_nll(ours[0], ids)
    # The training script measured this very quantity with transformers on the saved weights.
    assert nll == pytest.approx(STATS["heldout_nll_first_1024"], abs=1e-3)
    # Measured 4.53 on this slice (3.79 over the whole held-out split) against a unigram entropy of 6.38.
    assert nll < min(4.7, STATS["val_unigram_entropy"] - 1.5)
    assert mean_nll(stock[0], ids) == pytest.approx(nll, rel=1e-4)
