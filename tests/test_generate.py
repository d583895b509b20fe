"""lily_mlx's generate API and CLI against stock mlx_lm.generate on the same weights."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import batch_generate as stock_batch_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import lily_mlx
from conftest import subprocess_env

PROMPT = "Return a new dictionary with the keys"


@pytest.fixture(scope="module", params=["mlx", "mlx_q4"])
def pair(request, tiny_checkpoints):
    path = tiny_checkpoints[0][request.param]
    ours, tok = lily_mlx.load(str(path))
    stock, stock_tok = mlx_lm.load(str(path))
    return ours, stock, tok


def tokens_of(model, tok, prompt=PROMPT, n=24, gen=lily_mlx.stream_generate, **kw):
    return [r.token for r in gen(model, tok, prompt, max_tokens=n, **kw)]


def test_greedy_identical_to_mlx_lm_both_directions(pair):
    ours, stock, tok = pair
    want = tokens_of(stock, tok, gen=mlx_lm.stream_generate)
    assert len(want) == 24
    assert tokens_of(ours, tok) == want  # our loop, our model
    assert tokens_of(ours, tok, gen=mlx_lm.stream_generate) == want  # mlx-lm's loop drives our model
    assert tokens_of(stock, tok) == want  # our loop drives mlx-lm's model
    assert lily_mlx.generate(ours, tok, PROMPT, max_tokens=24) == mlx_lm.generate(stock, tok, PROMPT, max_tokens=24)


def test_sampled_identical_for_the_same_seed(pair):
    ours, stock, tok = pair
    kw = dict(sampler=make_sampler(0.9, top_p=0.95, top_k=50), logits_processors=make_logits_processors(repetition_penalty=1.3))
    mx.random.seed(7)
    want = tokens_of(stock, tok, gen=mlx_lm.stream_generate, **kw)
    mx.random.seed(7)
    assert tokens_of(ours, tok, **kw) == want


def test_stream_generate_fields_equal(pair):
    ours, stock, tok = pair
    a = list(lily_mlx.stream_generate(ours, tok, PROMPT, max_tokens=10, prefill_step_size=3))
    b = list(mlx_lm.stream_generate(stock, tok, PROMPT, max_tokens=10))
    assert [type(r) for r in a] == [type(r) for r in b]
    for x, y in zip(a, b):
        assert (x.text, x.token, x.prompt_tokens, x.generation_tokens, x.finish_reason, x.from_draft) == (
            y.text, y.token, y.prompt_tokens, y.generation_tokens, y.finish_reason, y.from_draft)
        assert np.allclose(np.array(x.logprobs), np.array(y.logprobs), atol=1e-4)
        assert x.prompt_tps > 0 and x.generation_tps > 0 and x.peak_memory >= 0
    assert a[-1].finish_reason == "length"


def test_batch_generate_equals_single_runs(pair):
    ours, _, tok = pair
    prompts = [tok.encode(p) for p in ("Return", "Open the file and return a", "A list of the keys")]
    assert len({len(p) for p in prompts}) == 3
    res = lily_mlx.batch_generate(ours, tok, prompts, max_tokens=8, return_token_ids=True)
    assert isinstance(res, lily_mlx.BatchResponse)
    for p, got in zip(prompts, res.token_ids):
        assert got == tokens_of(ours, tok, p, n=8)[: len(got)] and len(got) > 0
    assert res.token_ids == stock_batch_generate(ours, tok, prompts, max_tokens=8, return_token_ids=True).token_ids


def test_prompt_cache_and_max_kv_size(pair):
    ours, _, tok = pair
    cache = lily_mlx.make_cache(ours, max_kv_size=16)
    assert type(cache[3]).__name__ == "RotatingKVCache" and type(cache[0]).__name__ == "ArraysCache"
    long = tokens_of(ours, tok, PROMPT * 3, n=6, max_kv_size=16)
    assert len(long) == 6


def test_bad_arguments_are_refused(pair):
    ours, _, tok = pair
    with pytest.raises(ValueError, match="prompt is empty"):
        list(lily_mlx.generate_step(mx.array([], dtype=mx.int32), ours))
    with pytest.raises(ValueError, match="max_tokens"):
        list(lily_mlx.stream_generate(ours, tok, PROMPT, max_tokens=-5))
    with pytest.raises(NotImplementedError, match="speculative"):
        list(lily_mlx.stream_generate(ours, tok, PROMPT, draft_model=ours))
    with pytest.raises(NotImplementedError, match="adapter_path"):
        lily_mlx.load("embedded", adapter_path="x")


def test_enable_thinking_passes_through_the_chat_template(tiny_checkpoints):
    _, tok = lily_mlx.load(str(tiny_checkpoints[0]["mlx"]))
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")


def cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "lily_mlx.generate", *args], capture_output=True, text=True, input=stdin,
        env=subprocess_env(), timeout=300,
    )


def test_cli_end_to_end(tiny_checkpoints):
    path = str(tiny_checkpoints[0]["mlx_q4"])
    r = cli("--model", path, "--prompt", "-", "-m", "8", "--chat-template-config", '{"enable_thinking": false}', stdin="hello there")
    assert r.returncode == 0, r.stderr
    assert "Prompt:" in r.stdout and "tokens-per-sec" in r.stdout and "Peak memory:" in r.stdout
    ours, tok = lily_mlx.load(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    text = lily_mlx.generate(ours, tok, tok.encode(prompt, add_special_tokens=False), max_tokens=8)
    assert text in r.stdout
    r = cli("--model", path, "--prompt", "hi", "-m", "4", "--temp", "0.7", "--seed", "3", "--verbose", "false")
    assert r.returncode == 0 and "Prompt:" not in r.stdout and r.stdout.strip()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/model"], "no such model folder"),
        (["--prompt", ""], "prompt is empty"),
        (["-m", "-3"], "--max-tokens must be positive"),
        (["--chat-template-config", "{bad"], "not valid JSON"),
    ],
)
def test_cli_errors_are_one_line(tiny_checkpoints, args, message):
    full = ["--model", str(tiny_checkpoints[0]["mlx"]), *args] if "--model" not in args else args
    r = cli(*full)
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_cli_refuses_prompt_longer_than_context(tiny_checkpoints, tmp_path):
    path = shutil.copytree(tiny_checkpoints[0]["mlx"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    r = cli("--model", str(path), "--prompt", "one two three four five six seven eight nine ten")
    assert r.returncode == 2 and "over the model's context of 8" in r.stderr


def test_offline_hub_cache(tiny_checkpoints, tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub does, read with HF_HUB_OFFLINE=1 (no network)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--lily--tiny"
    shutil.copytree(tiny_checkpoints[0]["mlx"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, tok = lily_mlx.load("lily/tiny")
    assert model.config.hidden_size == 64 and tok.vocab_size > 0
    with pytest.raises(FileNotFoundError, match="lily/absent: not in the local hub cache"):
        lily_mlx.load("lily/absent")


def test_convert_per_expert_layout_loads_in_stock_mlx_lm(tiny_checkpoints, tmp_path):
    from lily_mlx.convert import main as convert_main

    src = tiny_checkpoints[0]["per_expert"]
    for quant in (False, True):
        out = tmp_path / f"out{int(quant)}"
        args = ["--hf-path", str(src), "--mlx-path", str(out)] + (["-q", "--q-group-size", "32"] if quant else [])
        assert convert_main(args) == 0
        stock, stock_tok = mlx_lm.load(str(out))
        ours, _ = lily_mlx.load(str(src))
        if quant:
            ours, _ = lily_mlx.load_model(src, quantize={"bits": 4, "group_size": 32})
        ids = mx.array([stock_tok.encode(PROMPT)])
        a, b = np.array(ours(ids)), np.array(stock(ids))
        assert np.abs(a - b).max() / np.abs(b).max() <= 1e-4
    assert convert_main(["--hf-path", str(src), "--mlx-path", str(out)]) == 2  # exists already


def test_lily_mlx_console_command_dispatches_generate(tiny_checkpoints):
    r = subprocess.run(
        [sys.executable, "-m", "lily_mlx.cli", "generate", "--model", str(tiny_checkpoints[0]["mlx"]), "-p", "hi", "-m", "4"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert r.returncode == 0 and "Generation:" in r.stdout, r.stderr


def test_importing_the_cli_module_keeps_generate_the_function():
    import importlib

    importlib.import_module("lily_mlx.generate")
    from lily_mlx.generate import generate_step, main  # noqa: F401

    assert callable(lily_mlx.generate) and lily_mlx.generate.__name__ == "generate"
    assert lily_mlx.generate is lily_mlx.generation.generate


def test_bounded_prefill_caps_the_memory_limit_and_restores_it(monkeypatch):
    from lily_mlx import memory
    from lily_mlx.memory import bounded_prefill

    before = mx.get_memory_limit()
    keep = mx.ones((1 << 18,))  # some active memory, so the cap sits above zero
    mx.eval(keep)
    monkeypatch.delenv(memory.HEADROOM_ENV, raising=False)
    with bounded_prefill():  # opt-in: nothing set, nothing changes
        assert mx.get_memory_limit() == before
    for how in ("arg", "env"):
        if how == "env":
            monkeypatch.setenv(memory.HEADROOM_ENV, "1M")
        with bounded_prefill(headroom=(1 << 20) if how == "arg" else None):
            inside = mx.get_memory_limit()
            assert mx.get_active_memory() < inside <= mx.get_active_memory() + (1 << 20), how
            y = mx.sum(mx.ones((1 << 20,)) * keep.sum())  # work past the cap still runs (the cap only throttles)
            assert y.item() == float(1 << 20) * (1 << 18)
        assert mx.get_memory_limit() == before
    with pytest.raises(RuntimeError):
        with bounded_prefill(headroom=1 << 20):
            raise RuntimeError("restored on errors too")
    assert mx.get_memory_limit() == before
    with bounded_prefill(headroom=1 << 62):  # never raised above the limit already set
        assert mx.get_memory_limit() == before
    assert memory.parse_size("2G") == 2 << 30 and memory.parse_size("512mb") == 512 << 20
    for bad in ("lots", "-1G", "0", "inf", "nan"):
        monkeypatch.setenv(memory.HEADROOM_ENV, bad)
        with pytest.raises(ValueError, match=memory.HEADROOM_ENV):
            with bounded_prefill():
                pass


def _spied_prefill(monkeypatch, spied: str):
    """(the embedded 4-bit model, its layer count, a 10-token prompt, the argument counts of the calls of mx.<spied>
    from here on, which still run, and the real mx.<spied>)."""
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    model, _ = lily_mlx.load_model(EMBEDDED_4BIT_MODEL)
    calls, real = [], getattr(mx, spied)
    monkeypatch.setattr(mx, spied, lambda *a: calls.append(len(a)) or real(*a))
    return model, len(model.language_model.model.layers), mx.array([[5, 9, 33, 7, 101, 2, 64, 12, 40, 41]]), calls, real


def test_bounded_prefill_layers_ahead(monkeypatch):
    """layers=N: the prefill waits for the half layer 2N - 1 back after dispatching each half (a mixer or a MoE
    block), so at most N layers are queued ahead,
    with the same logits as the unbounded prefill; a one-token step never waits; by default one layer ahead for
    chunks of memory.MIN_TOKENS or more; 0 is no bound; bad values name the variable."""
    from lily_mlx import memory

    monkeypatch.delenv(memory.HEADROOM_ENV, raising=False)
    monkeypatch.delenv(memory.LAYERS_ENV, raising=False)
    model, n_layers, prompt, waits, real_eval = _spied_prefill(monkeypatch, "eval")

    def run(**bound):
        waits.clear()
        cache = model.make_cache()
        with memory.bounded_prefill(**bound):
            out = model(prompt, cache=cache)
            real_eval(out)
            n = len(waits)
            model(prompt[:, :1], cache=cache)  # a decode step under the bound
        return out, n, len(waits) - n

    want, n, _ = run()
    assert n == 0 and memory.layers_ahead(10) is None  # 10 tokens: under the default's MIN_TOKENS
    for ahead in (1, 2):
        got, n, n_step = run(layers=ahead)
        assert mx.array_equal(got, want).item() and n == 2 * n_layers - (2 * ahead - 1) and n_step == 0, (ahead, n)
    monkeypatch.setattr(memory, "MIN_TOKENS", 10)  # the default bound now takes this prompt
    assert run()[1] == 2 * n_layers - (2 * memory.DEFAULT_LAYERS - 1)
    assert run(layers=0)[1] == 0
    monkeypatch.setenv(memory.LAYERS_ENV, "0")
    assert run()[1] == 0
    monkeypatch.setenv(memory.LAYERS_ENV, "2")
    assert run()[1] == 2 * n_layers - 3
    for bad in ("two", "-1"):
        monkeypatch.setenv(memory.LAYERS_ENV, bad)
        with pytest.raises(ValueError, match=memory.LAYERS_ENV):
            with memory.bounded_prefill():
                pass
    assert memory.layers_ahead(1 << 20) is None  # restored after the error


def test_prefill_overlap_dispatches_each_layer(monkeypatch):
    """prefill_overlap: a prefill below the run-ahead bound hands each decoder layer to the GPU (mx.async_eval) as
    soon as it is built, with the same logits; a one-token step dispatches nothing. Under mx.compile (as the
    compiled decoder traces several tokens) and under a bound, where no evaluation is allowed inside the trace,
    the prefill neither overlaps nor bounds, and runs."""
    from lily_mlx import memory, ops

    monkeypatch.delenv(memory.LAYERS_ENV, raising=False)
    model, n_layers, prompt, dispatched, _ = _spied_prefill(monkeypatch, "async_eval")

    def run(on: bool, tokens=prompt):
        dispatched.clear()
        with ops.switched("prefill_overlap", on):
            out = model(tokens, cache=model.make_cache())
        return out, len(dispatched)

    want, n_off = run(False)
    got, n_on = run(True)
    assert mx.array_equal(got, want).item()
    assert n_off == 1 and n_on == 1 + n_layers  # the embedding (the probe for a transformation), then each layer
    assert run(True, prompt[:, :1])[1] == 0
    with ops.switched("prefill_overlap", True), memory.bounded_prefill(layers=1):
        monkeypatch.setattr(memory, "MIN_TOKENS", 1)
        traced = mx.compile(lambda t: model(t, cache=model.make_cache()))(prompt)
    assert mx.allclose(traced, want, atol=1e-2).item()
