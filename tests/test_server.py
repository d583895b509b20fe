"""The OpenAI-compatible server, end to end: real server processes on 127.0.0.1, the openai client
(max_retries=0) and raw HTTP. Two servers start in parallel: `main` (auth, batch 64, small limits) and
`aux` (batch 1, queue 1, no prefix cache, short request timeout; SIGTERM-ed by the last test that uses it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

from test_server_fixtures import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 512
MAIN_FLAGS = ["--api-key", KEY, "--max-batch", "64", "--max-queue", "64", "--max-body-bytes", "65536",
              "--read-timeout", "1", "--max-context", "1024", "--max-tokens-limit", "512"]
AUX_FLAGS = ["--max-batch", "1", "--max-queue", "1", "--request-timeout", "4", "--prefix-cache-bytes", "0",
             "--max-context", "4096", "--max-tokens-limit", "4000", "--drain-timeout", "20"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, flags: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "lily_mlx.server", "--model", str(model_dir), "--served-model-name", "tiny",
               "--port", str(self.port), "--log-level", "warning", *flags]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_path.read_text()}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve_logs")
    procs = {name: ServerProcess(tiny_dir, logs / f"{name}.log", flags)
             for name, flags in (("main", MAIN_FLAGS), ("aux", AUX_FLAGS))}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def main(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def aux(servers):
    return servers["aux"]


CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION_OK = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def _assert_error(r: httpx.Response, status: int, param=None, code=None, where=""):
    assert r.status_code == status, f"{where}: expected {status}, got {r.status_code}: {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"{where}: {err}"
    assert isinstance(err["message"], str) and err["message"], where
    if param is not None:
        assert err["param"] == param, f"{where}: param {err['param']!r} != {param!r} ({err['message']})"
    if code is not None:
        assert err["code"] == code, f"{where}: code {err['code']!r} != {code!r}"
    return err


def _assert_healthy(c: httpx.Client, where=""):
    r = c.post("/v1/chat/completions", json=CHAT_OK)
    assert r.status_code == 200, f"after {where}: {r.text}"
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert c.get("/health").json()["status"] == "ok", f"after {where}"


def _raw(port: int, data: bytes, timeout: float = 10.0, half_close: bool = False) -> tuple[int, bytes]:
    """Send raw bytes; -> (status, body) of the response (read until the connection closes or the body is complete)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if half_close:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), None)
                if length is not None and len(body) >= length:
                    break
    status = int(buf.split(b" ", 2)[1]) if buf else 0
    return status, buf.partition(b"\r\n\r\n")[2]


def _bad_chat_cases():
    def chat(**kw):
        return {**CHAT_OK, **kw}

    def msgs(m):
        return {**CHAT_OK, "messages": m}

    cases = [
        ("invalid JSON", b'{"messages": [', 400, None),
        ("array body", b"[1, 2]", 400, None),
        ("string body", b'"hello"', 400, None),
        ("null body", b"null", 400, None),
        ("empty body", b"", 400, None),
        ("NaN literal", b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}', 400, None),
        ("number overflowing to inf", b'{"messages":[{"role":"user","content":"x"}],"temperature":1e400}', 400, "temperature"),
        ("deeply nested", b'{"messages":' + b"[" * 20000 + b"]" * 20000 + b"}", 400, None),
        ("not UTF-8", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', 400, None),
        ("unknown field", chat(foo=1), 400, "foo"),
        ("model type", chat(model=5), 400, "model"),
        ("missing messages", {"model": "tiny"}, 400, "messages"),
        ("empty messages", msgs([]), 400, "messages"),
        ("messages string", msgs("hi"), 400, "messages"),
        ("message not object", msgs([1]), 400, "messages[0]"),
        ("message no role", msgs([{"content": "x"}]), 400, "messages[0].role"),
        ("message bad role", msgs([{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
        ("message no content", msgs([{"role": "user"}]), 400, "messages[0].content"),
        ("message content int", msgs([{"role": "user", "content": 5}]), 400, "messages[0].content"),
        ("image part", msgs([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content[0].type"),
        ("text part without text", msgs([{"role": "user", "content": [{"type": "text"}]}]), 400, "messages[0].content[0].text"),
        ("message extra key", msgs([{"role": "user", "content": "x", "extra": 1}]), 400, "messages[0].extra"),
        ("tool_calls on user", msgs([{"role": "user", "content": "x", "tool_calls": []}]), 400, "messages[0].tool_calls"),
        ("tool call bad JSON", msgs([{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}, {"role": "user", "content": "x"}]),
         400, "messages[0].tool_calls[0].function.arguments"),
        ("tool call no name", msgs([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]),
         400, "messages[0].tool_calls[0].function.name"),
        ("unknown model", chat(model="gpt-4o"), 404, "model"),
        ("prompt over the context", msgs([{"role": "user", "content": "hello " * 3000}]), 400, None),
    ]
    bad_values = {
        "temperature": ["hot", True, -0.5, 2.5, [1]],
        "top_p": ["x", 1.5, -0.1],
        "top_k": [1.5, "3", -2],
        "min_p": [[], 1.5, -1],
        "seed": ["s", 1.5, 2**70],
        "stop": [123, [1], [""], ["a"] * 17, {"a": 1}, True],
        "max_tokens": ["10", 0, -1, 1.5, 100000],
        "max_completion_tokens": [0, "x"],
        "n": [0, 17, True, "2"],
        "logprobs": ["yes", 1],
        "top_logprobs": [21, -1, "x"],
        "presence_penalty": [2.5, "x"],
        "frequency_penalty": [-2.5, "y"],
        "repetition_penalty": [0, -1, "x"],
        "logit_bias": [[], {"abc": 1}, {str(VOCAB): 1}, {"99999": 5}, {"1": 500}, {"1": "x"}, {"-1": 1}],
        "stream": ["yes", 1],
        "tools": ["x", [1], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}], [{"type": "retrieval"}]],
        "tool_choice": ["required", "bogus", {"type": "function", "function": {"name": "f"}}],
        "response_format": [{"type": "json_object"}, "text"],
        "chat_template_kwargs": ["x", {"enable_thinking": "yes"}],
    }
    for name, values in bad_values.items():
        for v in values:
            body = chat(**{name: v})
            if name == "top_logprobs":
                body["logprobs"] = True
            cases.append((f"{name}={v!r}"[:60], body, 400, None))
    cases += [
        ("top_logprobs without logprobs", chat(top_logprobs=2), 400, "top_logprobs"),
        ("stream_options without stream", chat(stream_options={"include_usage": True}), 400, "stream_options"),
        ("stream_options bad type", chat(stream=True, stream_options={"include_usage": "x"}), 400, "stream_options.include_usage"),
        ("stream_options unknown key", chat(stream=True, stream_options={"foo": 1}), 400, "stream_options.foo"),
    ]
    return cases


def _bad_completion_cases():
    def comp(**kw):
        return {**COMPLETION_OK, **kw}

    return [
        ("no prompt", {"model": "tiny"}, 400, "prompt"),
        ("prompt int", comp(prompt=5), 400, "prompt"),
        ("prompt empty list", comp(prompt=[]), 400, "prompt"),
        ("prompt empty ids", comp(prompt=[[]]), 400, "prompt"),
        ("prompt mixed", comp(prompt=[1, "a"]), 400, "prompt"),
        ("prompt bools", comp(prompt=[True, False]), 400, "prompt"),
        ("prompt id out of vocab", comp(prompt=[[1, 99999]]), 400, "prompt"),
        ("prompt id = vocab", comp(prompt=[1, VOCAB]), 400, "prompt"),
        ("prompt id negative", comp(prompt=[-1]), 400, "prompt"),
        ("prompt empty string", comp(prompt=""), 400, "prompt"),
        ("prompt list with empty string", comp(prompt=["a", ""]), 400, "prompt"),
        ("too many prompts", comp(prompt=["a"] * 17), 400, "prompt"),
        ("logprobs too many", comp(logprobs=21), 400, "logprobs"),
        ("logprobs bool", comp(logprobs=True), 400, "logprobs"),
        ("echo with logprobs", comp(echo=True, logprobs=1), 400, "echo"),
        ("suffix", comp(suffix="x"), 400, "suffix"),
        ("best_of", comp(best_of=3), 400, "best_of"),
        ("stop wrong type", comp(stop=123), 400, "stop"),
        ("echo wrong type", comp(echo="yes"), 400, "echo"),
        ("n zero", comp(n=0), 400, "n"),
        ("repetition_context_size zero", comp(repetition_context_size=0), 400, "repetition_context_size"),
        ("logit_bias beyond vocab", comp(logit_bias={"600": 1}), 400, "logit_bias"),
        ("token prompt over the context", comp(prompt=[5] * 1100), 400, None),
        ("prompt + max_tokens over the context", comp(prompt=[5] * 700, max_tokens=400), 400, "max_tokens"),
        ("max_tokens over the server limit", comp(max_tokens=513), 400, "max_tokens"),
        ("unknown model", comp(model="tiny-2"), 404, "model"),
    ]


def test_bad_input_checklist(main):
    failures = []
    with main.client(headers=AUTH) as c:
        for path, cases in (("/v1/chat/completions", _bad_chat_cases()), ("/v1/completions", _bad_completion_cases())):
            for name, body, status, param in cases:
                where = f"{path} {name}"
                try:
                    content = body if isinstance(body, bytes) else json.dumps(body).encode()
                    r = c.post(path, content=content, headers={"content-type": "application/json"})
                    err = _assert_error(r, status, param=param, where=where)
                    if "over the context" in name:
                        assert err["code"] == "context_length_exceeded" and "1024" in err["message"], err
                    _assert_healthy(c, where)
                except AssertionError as e:
                    failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_auth_routes_and_body_limits(main):
    with main.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            _assert_error(c.post("/v1/chat/completions", json=CHAT_OK, headers=headers), 401, code="invalid_api_key")
        _assert_error(c.get("/v1/models"), 401)
        assert c.get("/health").status_code == 200  # health and metrics stay open for probes
        c.headers.update(AUTH)
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        _assert_error(c.get("/v1/models/nope"), 404)
        _assert_error(c.get("/v1/nope"), 404)
        _assert_error(c.get("/v1/chat/completions"), 405)
        _assert_healthy(c, "routes")

        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        # Declared body over the limit: refused from the headers alone.
        status, body = _raw(main.port, (head + "Content-Length: 100000\r\n\r\n").encode() + b"{" * 1000)
        assert status == 413 and "65536" in json.loads(body)["error"]["message"]
        _assert_healthy(c, "413 content-length")
        # Chunked body that grows past the limit.
        chunk = b"x" * 30000
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
        status, body = _raw(main.port, (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + chunked)
        assert status == 413, body
        _assert_healthy(c, "413 chunked")
        # Content-Length longer than the body: answered after --read-timeout (1 s), not left hanging.
        t0 = time.monotonic()
        status, body = _raw(main.port, (head + "Content-Length: 200\r\n\r\n").encode() + b'{"messages": [')
        assert status == 400 and json.loads(body)["error"]["code"] == "body_read_timeout", body
        assert time.monotonic() - t0 < 5
        _assert_healthy(c, "short body")


def test_list_and_token_prompts(main):
    with main.client(headers=AUTH) as c:
        r = c.post("/v1/completions", json={**COMPLETION_OK, "prompt": ["Hello", "The quick"], "n": 2}).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        assert r["choices"][0]["text"] == r["choices"][1]["text"]  # greedy: n copies agree
        ids = [[10, 20, 30], [40, 50]]
        r = c.post("/v1/completions", json={**COMPLETION_OK, "prompt": ids}).json()
        assert len(r["choices"]) == 2 and r["usage"]["prompt_tokens"] == 5
        single = c.post("/v1/completions", json={**COMPLETION_OK, "prompt": ids[0]}).json()
        assert single["choices"][0]["text"] == r["choices"][0]["text"]
        echo = c.post("/v1/completions", json={**COMPLETION_OK, "prompt": "Hello", "echo": True}).json()
        assert echo["choices"][0]["text"].startswith("Hello")


def test_openai_client_semantics(main):
    import openai

    client = openai.OpenAI(base_url=main.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, extra_body=no_think)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens >= 0
    assert len(ch.logprobs.content) == 12 and all(len(e.top_logprobs) == 3 for e in ch.logprobs.content)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in ch.logprobs.content)
    text = ch.message.content

    # Streaming gives the same greedy text, usage last, then [DONE] (the client stops on it).
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=no_think))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    # max_completion_tokens, a stop string cut out of the greedy text, logit_bias forcing the EOS token.
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, temperature=0, extra_body=no_think)
    assert r.usage.completion_tokens == 5
    stop = text[4:7]
    if stop.strip() and text.find(stop) == 4:
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stop=[stop, "zzzz"], extra_body=no_think)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[:4]
    eos = 2  # <|im_end|>
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, logit_bias={str(eos): 100}, extra_body=no_think)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "" and r.usage.completion_tokens == 1

    # Seeded sampling is reproducible, whatever else is batched; n choices differ from each other.
    kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, n=3, extra_body={"top_k": 50, "min_p": 0.01, **no_think})
    a = [c.message.content for c in client.chat.completions.create(**kw).choices]
    b = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert a == b and len(set(a)) > 1
    # A logit_bias of +8 makes greedy repeat one token; a frequency penalty of 2 per occurrence breaks the run after ~4.
    def run_of(**kw):
        r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, logprobs=0, logit_bias={"300": 8}, **kw)
        tokens = r.choices[0].logprobs.tokens
        return tokens.count(tokens[0])
    assert run_of() == 8
    assert run_of(frequency_penalty=2.0) <= 5
    assert run_of(extra_body={"repetition_penalty": 100.0}) == 1  # the biased logit is positive, so it is divided by 100

    comp = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    assert comp.choices[0].finish_reason == "length" and len(comp.choices[0].logprobs.token_logprobs) == 6
    assert all(len(t) <= 2 for t in comp.choices[0].logprobs.top_logprobs)
    lp = comp.choices[0].logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_reasoning_content_and_tool_calls(main, tiny_dir):
    from mlx_lm.utils import load_tokenizer

    from lily_mlx.server.output import ChoiceOutput

    with main.client(headers=AUTH) as c:
        # enable_thinking (the template default) opens <think> in the prompt: output is reasoning until </think> (id 4, barred here).
        r = c.post("/v1/chat/completions", json={**CHAT_OK, "max_tokens": 8, "logit_bias": {"4": -100}}).json()
        msg = r["choices"][0]["message"]
        assert msg["content"] == "" and msg["reasoning_content"]
        r = c.post("/v1/chat/completions", json={**CHAT_OK, "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert "reasoning_content" not in r["choices"][0]["message"]

    tok = load_tokenizer(tiny_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    out = ChoiceOutput(tok, stops=[], chat=True, initial_state="reasoning", tools=tools)
    text = "plan it</think>\n\nSure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    deltas = [out.feed(t, None)[0] for t in tok.encode(text, add_special_tokens=False)] + [out.finish("stop")]
    assert "".join(d.reasoning for d in deltas) == "plan it"
    assert "".join(d.content for d in deltas).strip() == "Sure."
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and out.made_tool_call


def test_collector_formats_reasoning_tool_calls_and_usage(tiny_dir):
    from types import SimpleNamespace

    from mlx_lm.utils import load_tokenizer

    from lily_mlx.server.app import Collector
    from lily_mlx.server.output import Delta

    server = SimpleNamespace(tokenizer=load_tokenizer(tiny_dir), cfg=SimpleNamespace(model_id="tiny"))
    col = Collector(server, "chat", "x", 1, [10])
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    events = [("prompt", 0, 7), ("delta", 0, Delta(reasoning="think")), ("delta", 0, Delta(content="Hi", tool_calls=[call])),
              ("finish", 0, "tool_calls", Delta(), 5)]
    chunks = [col.chunk(c, d, r, False) for ev in events for c, d, r in col.apply(ev)]
    assert [ch["choices"][0]["delta"] for ch in chunks] == [
        {"reasoning_content": "think"}, {"content": "Hi", "tool_calls": [{"index": 0, **call}]}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and col.done
    final = col.final(False)
    assert final["choices"][0]["message"] == {"role": "assistant", "content": "Hi", "reasoning_content": "think", "tool_calls": [call]}
    assert final["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 7}}


def test_stop_matcher_holds_back_partial_stops():
    from lily_mlx.server.output import StopMatcher

    m = StopMatcher(["o w", "END"])
    assert m.feed("Hel") == ("Hel", False)
    assert m.feed("lo") == ("l", False)  # "o" may start "o w"
    assert m.feed(" wor") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("abcE") == ("abc", False) and m.feed("N") == ("", False) and m.flush() == "EN"


def _sse(lines) -> tuple[list[dict], bool]:
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def _stream_text(c: httpx.Client, body: dict) -> tuple[str, str, bool]:
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events, done = _sse(r.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    return text, (reasons or [None])[-1], done


def test_64_concurrent_streams_match_sequential(main):
    prompts = [f"Request number {i}: tell me about {w}." for i, w in enumerate(["foxes", "dogs", "models", "weather"] * 4)]

    def body(p):
        return {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}

    with main.client(headers=AUTH) as c:
        expected = {p: _stream_text(c, body(p)) for p in prompts}
        steps0 = _metric(c, "lily_decode_steps_total")
    assert all(done and reason in ("stop", "length") for _, reason, done in expected.values())

    results, errors = [None] * 64, []

    def client_thread(i):
        try:
            with main.client(headers=AUTH) as c:
                results[i] = _stream_text(c, body(prompts[i % len(prompts)]))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    mismatched = [i for i in range(64) if results[i] != expected[prompts[i % len(prompts)]]]
    assert not mismatched, f"{len(mismatched)} of 64 streams differ from the sequential run, e.g. {results[mismatched[0]]}"
    with main.client(headers=AUTH) as c:
        steps = _metric(c, "lily_decode_steps_total") - steps0
    tokens = 64 * 24
    assert steps < tokens / 4, f"{steps} decode steps for up to {tokens} tokens: requests were not batched"


def _wait_metric(c: httpx.Client, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(c, name) != value:
        assert time.monotonic() < deadline, f"{name} did not reach {value} within {timeout} s"
        time.sleep(0.02)


def _metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_prefix_cache_multi_turn(main, aux, tiny_dir):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    def turn(server, messages, headers):
        with server.client(headers=headers) as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0,
                                                      "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, r.text
            return r.json()

    msgs = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hello there, how are you?"}]
    r1 = turn(main, msgs, AUTH)
    for follow_up in ("Tell me more.", "And then what happened?"):
        # The previous turn snapshotted the end of its last user message; this turn resumes there, so only the
        # reply, the new user message and the generation prompt are prefilled.
        resume = len(tok.apply_chat_template(msgs, add_generation_prompt=False, enable_thinking=False))
        msgs = msgs + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": follow_up}]
        r2 = turn(main, msgs, AUTH)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == resume, (resume, r2["usage"])
        ref = turn(aux, msgs, {})  # the same request on a server without a prefix cache
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert r2["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        again = turn(main, msgs, AUTH)  # the same prompt again: everything but the last token is cached
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
        assert again["choices"][0]["message"] == r2["choices"][0]["message"]
        r1 = r2
    with main.client() as c:
        assert _metric(c, 'lily_prefix_cache_lookups_total{result="hit"}') >= 4


def test_disconnect_cancels_work(aux):
    """aux decodes one sequence at a time, so the next request can only start once the abandoned one is dropped."""
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "logit_bias": {"2": -100}}  # no EOS
    quick = {"model": "tiny", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    with aux.client() as c:
        # Streaming: read a few chunks, then drop the connection.
        with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break
        t0 = time.monotonic()
        assert c.post("/v1/completions", json=quick).status_code == 200
        assert time.monotonic() - t0 < 1.0
    # Non-streaming: a raw request whose client goes away while it runs.
    data = json.dumps(long).encode()
    s = socket.create_connection(("127.0.0.1", aux.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    time.sleep(0.5)
    s.close()
    time.sleep(0.1)
    with aux.client() as c:
        t0 = time.monotonic()
        assert c.post("/v1/completions", json=quick).status_code == 200
        assert time.monotonic() - t0 < 1.0
        assert _metric(c, "lily_running_sequences") == 0


def test_queue_full_timeout_and_error_after_headers(aux):
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": True, "logit_bias": {"2": -100}}
    lines: dict[str, list] = {"a": [], "b": []}

    def stream(name):
        with aux.client() as c, c.stream("POST", "/v1/completions", json=long) as r:
            lines[name] = list(r.iter_lines())

    ta = threading.Thread(target=stream, args=("a",))
    ta.start()
    with aux.client() as c:
        _wait_metric(c, "lily_running_sequences", 1)
        tb = threading.Thread(target=stream, args=("b",))  # waits in the queue (max-queue 1) behind a
        tb.start()
        _wait_metric(c, "lily_queue_depth", 1)
        _assert_error(c.post("/v1/completions", json={**long, "stream": False}), 429, code="queue_full")
    ta.join(20)
    tb.join(20)
    # --request-timeout 4: both streams end with an error event, then [DONE].
    for name in "ab":
        events, done = _sse(lines[name])
        assert done and "error" in events[-1] and events[-1]["error"]["code"] == "request_timeout", (name, events[-3:])
    with aux.client() as c:
        _assert_error(c.post("/v1/completions", json={**long, "stream": False, "n": 2}), 400, param="n")  # n > --max-batch 1
        t0 = time.monotonic()
        _assert_error(c.post("/v1/completions", json={**long, "stream": False}), 504, code="request_timeout")
        assert 3 < time.monotonic() - t0 < 8
        _assert_healthy(c, "timeouts")


def test_sigterm_drains_then_exits_zero(aux):
    """Runs last on aux: one stream decoding, one waiting in the queue; both finish after SIGTERM, new work gets 503.
    The first stream is sized to last about 1.5 s at the measured speed: long enough to still be running when
    the drain is checked, short enough that the queued one ends within aux's --request-timeout of 4 s."""
    def body(n):
        return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": n, "temperature": 0, "stream": True, "logit_bias": {"2": -100}}

    with aux.client() as c:
        t0 = time.monotonic()
        assert c.post("/v1/completions", json={**body(20), "stream": False}).status_code == 200
        per_token = (time.monotonic() - t0) / 20
    n_first = max(20, min(1000, int(1.5 / per_token)))
    results, started = {}, threading.Event()

    def stream(i, n):
        with aux.client() as c, c.stream("POST", "/v1/completions", json=body(n)) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if '"text":"' in line:
                    started.set()
            results[i] = _sse(lines)

    first = threading.Thread(target=stream, args=(0, n_first))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=stream, args=(1, 20))  # queued behind the first (max-batch 1)
    second.start()
    time.sleep(0.2)
    aux.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    with aux.client() as c:
        assert c.get("/health").json()["status"] == "draining"
        _assert_error(c.post("/v1/completions", json={**body(5), "stream": False}), 503, code="draining")
    first.join(30)
    second.join(30)
    for i, n in ((0, n_first), (1, 20)):
        events, done = results[i]
        assert done and events[-1]["choices"][0]["finish_reason"] == "length", events[-2:]
        assert sum(1 for e in events if e["choices"] and e["choices"][0]["text"]) >= n // 2
    assert aux.proc.wait(30) == 0


def test_load_failure_exits_nonzero(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "lily_mlx.server", "--model", str(tmp_path / "missing"), "--port", str(_free_port())],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "no such model folder" in p.stderr


def test_warm_up_only_builds_then_exits(tiny_dir, tmp_path):
    """--warm-up-only: load, the warm-up (each piece logged with its time), exit 0 without serving; a model that does
    not load exits 1, and --no-warmup beside it (or beside --warm-up-workers) is refused."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "lily_mlx.server", "--warm-up-only", *args], capture_output=True,
                              text=True, timeout=180, env=env)

    p = serve("--model", str(tiny_dir), "--max-batch", "2", "--prefill-step", "8")
    assert p.returncode == 0, p.stderr[-2000:]
    for piece in ("decode step of 1 row in", "decode step of 2 rows in", "prefill of 2 tokens in", "prefill of 8 tokens in"):
        assert f"warm-up: {piece}" in p.stderr, p.stderr[-2000:]
    assert "prefill of 16 tokens" not in p.stderr and "model ready" in p.stderr
    p = serve("--model", str(tmp_path / "missing"))
    assert p.returncode == 1 and "no such model folder" in p.stderr, p.stderr[-2000:]
    p = serve("--model", str(tiny_dir), "--no-warmup")
    assert p.returncode == 2 and "--warm-up-only and --no-warmup contradict" in p.stderr
    p = subprocess.run([sys.executable, "-m", "lily_mlx.server", "--model", str(tiny_dir), "--no-warmup",
                        "--warm-up-workers", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 2 and "--warm-up-workers and --no-warmup contradict" in p.stderr


def test_warm_up_workers_run_each_piece_once_then_the_server_its_own_pass(tiny_dir, tmp_path, caplog):
    """--warm-up-workers 2: two processes holding the first layers run the pieces between them (each piece in one),
    all before the server's own pass; workers that cannot load only cost a warning, the server still warms up."""
    import logging
    import re

    import lily_mlx
    from lily_mlx.server.engine import Engine

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "lily_mlx.server", "--warm-up-only", "--warm-up-workers", "2", "--model",
                        str(tiny_dir), "--max-batch", "2", "--prefill-step", "8"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warm-up: 5 pieces in 2 worker processes" in p.stderr
    lines = p.stderr.splitlines()
    done = [(m.group(1), m.group(2)) for m in (re.search(r"\(worker (\d+)\): warm-up: (.+) in [\d.]+ s", l) for l in lines) if m]
    labels = ["decode step of 1 row", "decode step of 2 rows", "prefill of 2 tokens", "prefill of 4 tokens",
              "prefill of 8 tokens"]
    assert sorted(label for _, label in done) == sorted(labels) and len({w for w, _ in done}) == 2, done
    last_worker = max(i for i, l in enumerate(lines) if "(worker " in l)
    first_own = next(i for i, l in enumerate(lines) if "lily_mlx.server: warm-up: decode step of 1 row in" in l)
    assert last_worker < first_own

    model, tok = lily_mlx.load(str(tiny_dir))
    with caplog.at_level(logging.INFO, logger="lily_mlx.server"):
        engine = Engine(lambda: (model, tok), max_batch=2, prefill_step=8, warmup=True, warm_up_workers=2,
                        model_path=str(tmp_path / "missing")).start()
        try:
            assert engine.ready.wait(120) and engine.dead is None
        finally:
            engine.stop()
    said = [r.getMessage() for r in caplog.records]
    assert sum("exited with 1; the server builds its pieces itself" in m for m in said) == 2, said
    assert any(m.startswith("warm-up: prefill of 8 tokens in") for m in said)


def _warm_up_traced(path, layers: Optional[int]) -> set:
    """The kernel builds (name, source) the warm-up of `path`'s first `layers` (None: all) launches on the CUDA path,
    traced on this CPU."""
    from bench.step_dispatch import cuda_builds_traced
    from lily_mlx import ops
    from lily_mlx.loading import load_model
    from lily_mlx.server import warm_up
    from lily_mlx.server.engine import Engine

    built: set = set()
    with cuda_builds_traced(lambda: built), ops.switched("batched_prefill", True):
        engine = Engine(lambda: None, max_batch=4, prefill_step=128)
        engine.model, _ = load_model(path, layers=layers)
        for _, run in warm_up.pieces(engine):
            run()
    return built


def test_a_workers_first_layers_launch_the_kernels_of_the_whole_model(tmp_path):
    """What --warm-up-workers rests on: with the CUDA path traced on this CPU (each launch a stand-in recording the
    source MLX would build), the warm-up of an 8-layer model's first layers (layers_to_hold: up to the first attention
    layer) launches exactly the kernel builds of the whole model's warm-up, and builds every fused kernel of MLX's
    compile that the whole model's warm-up builds: MLX's CPU backend writes those to $TMPDIR/mlx/<version>/cpu by the
    name of the fused graph (as its CUDA backend names its PTX), so the whole model, run after the first layers in the
    same folder, writes nothing new. The first 3 layers (no attention layer) write 6 of the 42 files (source and library)."""
    import tiny
    from lily_mlx.server import warm_up

    hf = tiny.write_hf(tiny.hf_model(num_hidden_layers=8), tmp_path / "eight")
    path = tiny.write_mlx(hf, tmp_path / "eight_q4", quantize=True, group_size=32, bits=4)
    held = warm_up.layers_to_hold(str(path))
    whole, first = _warm_up_traced(path, None), _warm_up_traced(path, held)
    assert held == 4 and {"qmv", "deltanet_chunk", "moe_sort", "logprobs"} <= {n for n, _ in whole}
    assert first == whole, sorted(n for n, _ in first ^ whole)

    fused = tmp_path / "tmp" / "mlx"
    traced = ("import sys; sys.path[:0] = [sys.argv[1]]; from test_server import _warm_up_traced; "
              "_warm_up_traced(sys.argv[2], None if sys.argv[3] == 'all' else int(sys.argv[3]))")
    written = []
    for layers in (held, "all"):
        fused.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", traced, str(REPO / "tests"), str(path), str(layers)], check=True,
                       env={**os.environ, "TMPDIR": str(fused.parent)}, timeout=300)
        written.append({f.name for f in fused.rglob("*") if f.is_file()} - set().union(*written))
    assert len(written[0]) > 12 and written[1] == set(), sorted(written[1])


def test_engine_death_fails_requests_and_reports(tiny_dir):
    """A failure of the loop itself (here: the model cannot make a cache) answers open requests and calls on_death."""
    import lily_mlx
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))

    def broken():
        raise RuntimeError("no cache today")

    model.make_cache = broken
    died, events = threading.Event(), []
    engine = Engine(lambda: (model, tok), on_death=lambda e: died.set()).start()
    assert engine.ready.wait(30)
    req = Request([[1, 2, 3]], [[2]], [4], SamplingParams(temperature=0), [ChoiceOutput(tok, [], chat=False)], events.extend, 30)
    engine.submit(req)
    assert died.wait(10) and engine.dead is not None
    assert events and events[-1][0] == "error" and events[-1][1].code == "engine_dead"


def test_503_while_loading(tiny_dir):
    """The app answers before the model is ready: /health and generation say 503 'loading' until the loader returns."""
    from starlette.testclient import TestClient

    import lily_mlx
    from lily_mlx.server.app import Server, ServerConfig, create_app
    from lily_mlx.server.engine import Engine
    from lily_mlx.server.metrics import Metrics

    release = threading.Event()

    def slow_loader():
        release.wait(30)
        return lily_mlx.load(str(tiny_dir))

    metrics = Metrics()
    engine = Engine(slow_loader, metrics=metrics).start()
    app = create_app(Server(ServerConfig(model=str(tiny_dir), served_model_name="tiny"), engine, metrics))
    try:
        with TestClient(app) as c:
            assert c.get("/health").json() == {"status": "loading"}
            _assert_error(c.post("/v1/chat/completions", json=CHAT_OK), 503, code="loading")
            release.set()
            assert engine.ready.wait(30)
            assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json=CHAT_OK)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        engine.stop()


def _wait_finished(reqs: list, watch=lambda: False, timeout: float = 60.0) -> bool:
    """Waits for the engine's requests to finish; whether `watch()` held at some poll meanwhile."""
    deadline, seen = time.monotonic() + timeout, False
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, "requests did not finish"
        seen = seen or watch()
        time.sleep(0.001)
    return seen


def _wait_until(cond, possible, timeout: float = 30.0) -> None:
    """Polls until cond() holds, asserting possible() (the scenario can still happen) meanwhile."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline and possible()
        time.sleep(0.001)


def _serve_greedy(model, tok, specs, after=None, watch=None) -> tuple[list, bool]:
    """An engine over greedy requests specs [(text, max new tokens)], submitted in turn; after(i, engine, reqs,
    events), when given, runs once request i is in (to wait for what the next should find). -> (each request's
    events, whether watch(engine) held at some poll while they finished)."""
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    engine = Engine(lambda: (model, tok)).start()
    assert engine.ready.wait(30)
    events, reqs = [[] for _ in specs], []
    try:
        for i, (text, n_tokens) in enumerate(specs):
            req = Request([tok.encode(text)], [[]], [n_tokens], SamplingParams(temperature=0),
                          [ChoiceOutput(tok, [], chat=False)], events[i].extend, 60)
            reqs.append(req)
            engine.submit(req)
            if after is not None:
                after(i, engine, reqs, events)
        seen = _wait_finished(reqs, lambda: watch is not None and watch(engine))
    finally:
        engine.stop()
    return events, seen


def _greedy_texts(model, tok, specs, after=None) -> list[str]:
    """_serve_greedy's requests, each as its text and finish event."""
    events, _ = _serve_greedy(model, tok, specs, after)
    return ["".join(str(e[2]) for e in ev if e[0] == "delta") + str(ev[-1][1:]) for ev in events]


def _each_decoding(first: int) -> Callable:
    """An after() for _serve_greedy: each request before `first` has streamed two deltas before the next comes."""
    def after(i, engine, reqs, events):
        if i < first:
            _wait_until(lambda: sum(e[0] == "delta" for e in events[i]) >= 2, lambda: not reqs[i].finished)
    return after


def _step_modes(monkeypatch, seen: Optional[Callable] = None) -> list:
    """Each decode step's (rows, how it ran: solo, slots or eager), recorded from Engine._step (seen(engine) first)."""
    from lily_mlx.server.engine import Engine

    modes, real_step = [], Engine._step

    def step(self, inputs):
        if seen is not None:
            seen(self)
        modes.append((len(self._rows), "solo" if self._solo else "slots" if self._slots else "eager"))
        return real_step(self, inputs)

    monkeypatch.setattr(Engine, "_step", step)
    return modes


def test_lone_sequence_decodes_compiled_then_joins_a_batch(tiny_dir):
    """A sequence running alone decodes through the compiled step; when a second request arrives, its state is
    written back and both continue batched. Greedy text equals the eager batched path's (compiled_decode off)."""
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))
    prompts = [tok.encode("The first request talks about foxes and"), tok.encode("A second one, about dogs:")]

    def run():
        engine = Engine(lambda: (model, tok)).start()
        assert engine.ready.wait(30)
        events, reqs, solo_seen = [[], []], [], False
        try:
            for i, p in enumerate(prompts):
                req = Request([p], [[]], [48 - 24 * i], SamplingParams(temperature=0),
                              [ChoiceOutput(tok, [], chat=False)], events[i].extend, 60)
                reqs.append(req)
                engine.submit(req)
                deadline = time.monotonic() + 30
                while i == 0 and sum(e[0] == "delta" for e in events[0]) < 3:  # the first is decoding, alone
                    assert time.monotonic() < deadline and not req.finished
                    solo_seen = solo_seen or engine._solo is not None
                    time.sleep(0.001)
            _wait_finished(reqs)
        finally:
            engine.stop()
        texts = ["".join(str(e[2]) for e in ev if e[0] == "delta") + str(ev[-1][1:]) for ev in events]
        return texts, solo_seen

    compiled, solo = run()
    with ops.disabled("compiled_decode"):
        eager, solo_off = run()
    assert solo and not solo_off
    assert compiled == eager


def test_slot_batch_decodes_compiled_through_joins_and_leaves(tiny_dir, monkeypatch):
    """Four requests of different prompt lengths and lengths of output: the first decodes alone, the next join it in
    a SlotBatchDecoder (grown from 2 slots to 4, a longer prompt moving the rows right), rows leave (the slots
    compact) and the last goes on alone again. Every step is compiled, joins and leaves trace nothing (one trace a
    slot count and capacity), and the greedy text equals the eager batched path's (compiled_decode off)."""
    import lily_mlx
    import lily_mlx.decode as decode
    import lily_mlx.model as model_mod
    from lily_mlx import ops

    model, tok = lily_mlx.load(str(tiny_dir))
    specs = [("Foxes", 64), ("A longer prompt about the habits of dogs and", 28), ("Models serve", 40),
             ("Late arrival:", 20)]
    shapes, traced, real_trace = set(), [], decode._batch_step  # the slot batches' (slots, capacity); traces

    def seen(engine):
        if engine._slots is not None:
            shapes.add((engine._slots.slots, engine._slots.kv[0][0].shape[2]))

    modes = _step_modes(monkeypatch, seen)
    monkeypatch.setattr(decode, "_batch_step", lambda *a: traced.append(1) or real_trace(*a))

    def run():
        modes.clear()
        return _greedy_texts(model, tok, specs, _each_decoding(3))  # each joins a batch that decodes

    compiled = run()
    assert {m for _, m in modes} == {"solo", "slots"}, modes
    assert modes[0] == (1, "solo") and modes[-1] == (1, "solo")
    assert (4, "slots") in modes and len(traced) == len(shapes) and {s for s, _ in shapes} >= {2, 4}
    with ops.disabled("compiled_decode"):
        eager = run()
    assert {m for _, m in modes} == {"eager"}
    assert compiled == eager
    # batched_attn_decode (opt-in): the left-padded rows' attention through ops.attention_decode (each row from
    # its first column, at its own RoPE position), compiled and eager, gives the same text.
    rows_taken = []
    real = model_mod.ops.attention_decode
    monkeypatch.setattr(model_mod.ops, "attention_decode",
                        lambda *a, **k: rows_taken.append(k.get("row_start") is not None) or real(*a, **k))
    with ops.switched("batched_attn_decode", True):
        assert run() == compiled
        with ops.disabled("compiled_decode"):
            assert run() == compiled
    assert any(rows_taken), "no batched row went through ops.attention_decode"


def test_one_token_prompt_first_decodes_in_slots(tiny_dir, monkeypatch):
    """A one-token prompt has nothing to prefill, so no cache to lay a batch out from: alone, and with the requests
    that join it, it still decodes compiled in slots (laid out from a one-token forward's shapes), not eagerly, and
    its greedy text is the eager path's."""
    import lily_mlx
    from lily_mlx import ops

    model, tok = lily_mlx.load(str(tiny_dir))
    assert len(tok.encode("x")) == 1
    specs = [("x", 40), ("Foxes and", 12), ("Models serve", 20)]
    modes = _step_modes(monkeypatch)

    def run():
        modes.clear()
        return _greedy_texts(model, tok, specs, _each_decoding(len(specs)))

    compiled = run()
    assert modes[0] == (1, "slots") and all(m != "eager" for _, m in modes), modes
    with ops.disabled("compiled_decode"):
        assert run() == compiled
    assert {m for _, m in modes} == {"eager"}


def test_warm_up_runs_one_batch_per_kernel_build_before_ready(tiny_dir, monkeypatch, caplog):
    """--warmup (the CLI's default) decodes a batch of each kernel row bucket up to --max-batch before the engine
    says ready, and leaves nothing behind: a request after it decodes as it does without."""
    import logging

    import lily_mlx
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))
    rows, call = [], type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, x, *a, **k: (rows.append(x.shape[0]), call(self, x, *a, **k))[1])

    def run(warmup, max_batch):
        model, _ = lily_mlx.load(str(tiny_dir))  # its own: a model's compiled steps are traced once, then shared
        rows.clear()
        engine = Engine(lambda: (model, tok), max_batch=max_batch, warmup=warmup).start()
        try:
            assert engine.ready.wait(60)
            warm = sorted(set(rows))
            events = []
            req = Request([tok.encode("Warm kernels and")], [[]], [12], SamplingParams(temperature=0),
                          [ChoiceOutput(tok, [], chat=False)], events.extend, 60)
            engine.submit(req)
            deadline = time.monotonic() + 60
            while not req.finished:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            engine.stop()
        return warm, "".join(str(e[2]) for e in events if e[0] == "delta")

    with caplog.at_level(logging.INFO, logger="lily_mlx.server"):
        warm3, text3 = run(True, 3)
        warm32, _ = run(True, 32)
    assert warm3 == [1, 2, 4] and warm32 == [1, 2, 4, 8]  # 3 rows run in 4 slots; past 8 no kernel applies
    assert any("warm-up: decode steps of 1 to 3 rows" in r.getMessage() for r in caplog.records)
    cold, text = run(False, 3)
    assert cold == [] and text3 == text and text


@pytest.mark.parametrize("batched_prefill", [False, True])
def test_warm_up_launches_every_kernel_the_first_requests_launch(tiny_dir, batched_prefill):
    """With the CUDA path traced on this CPU (each kernel launch a stand-in that records the source MLX would build),
    the requests after the warm-up launch no kernel it did not: prompts of 3 to 300 tokens arriving together,
    prefilled alone or grouped and decoded in slots, their logprobs. The prefill's kernels, picked by rows, and the
    logprobs kernel were built inside the first requests before (30 s of no output on a cold H100, run 91)."""
    import lily_mlx
    from bench.step_dispatch import cuda_builds_traced
    from lily_mlx import ops
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    built: dict[str, set] = {"warm-up": set(), "requests": set()}
    phase = ["warm-up"]

    with cuda_builds_traced(lambda: built[phase[0]]), ops.switched("batched_prefill", batched_prefill):
        model, tok = lily_mlx.load(str(tiny_dir))
        engine = Engine(lambda: (model, tok), max_batch=4, warmup=True).start()
        try:
            assert engine.ready.wait(120)
            phase[0] = "requests"
            reqs = [Request([[5 + i] * n], [[]], [3], SamplingParams(temperature=0), [ChoiceOutput(tok, [], chat=False)],
                            lambda events: None, 120) for i, n in enumerate((3, 17, 40, 130, 300))]
            for req in reqs:
                engine.submit(req)
            deadline = time.monotonic() + 120
            while not all(r.finished for r in reqs):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            engine.stop()
    assert {"deltanet_chunk", "moe_sort", "logprobs"} <= {name for name, _ in built["requests"]}  # the CUDA path ran
    assert built["requests"] <= built["warm-up"], sorted(name for name, _ in built["requests"] - built["warm-up"])


def test_pipelined_decode_equals_unpipelined(tiny_dir):
    """server_pipeline queues each step before the host reads the last: a lone greedy sequence, then a mixed batch
    joining and leaving (seeded sampling with top logprobs, n=2, a stop string, logit_bias, the three penalties,
    whose processors read the unread tokens on the GPU, lengths ending at different steps) give the same events with
    it on and off, and the pipelined run really had a step queued ahead."""
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))
    specs = [("A lone sequence about foxes and", SamplingParams(temperature=0), [], 30),
             ("Seeded, with logprobs:", SamplingParams(temperature=0.9, top_p=0.9, seed=7, logprobs=True,
                                                      top_logprobs=3, n=2), [], 17),
             ("Stops at a word:", SamplingParams(temperature=0), [" the"], 25),
             ("Biased toward token 5:", SamplingParams(temperature=0, logit_bias={5: 3.0, 9: -100.0}), [], 12),
             ("Penalised:", SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, repetition_context_size=6),
              [], 19),
             ("Presence and frequency:", SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.8), [],
              21)]

    def run():
        engine = Engine(lambda: (model, tok)).start()
        assert engine.ready.wait(30)
        events, reqs, queued_seen = [[] for _ in specs], [], False
        try:
            for i, (text, params, stops, n_tokens) in enumerate(specs):
                outs = [ChoiceOutput(tok, stops, chat=False) for _ in range(params.n)]
                req = Request([tok.encode(text)], [[]], [n_tokens], params, outs, events[i].extend, 60)
                reqs.append(req)
                engine.submit(req)
                deadline = time.monotonic() + 30
                while i == 0 and sum(e[0] == "delta" for e in events[0]) < 4:  # the first decodes alone a while
                    assert time.monotonic() < deadline and not req.finished
                    queued_seen = queued_seen or engine._queued is not None
                    time.sleep(0.001)
            queued_seen = _wait_finished(reqs, lambda: engine._queued is not None) or queued_seen
        finally:
            engine.stop()
        assert not any(e[0] == "error" for ev in events for e in ev), events
        return [[(e[0], *map(str, e[1:])) for e in ev] for ev in events], queued_seen

    pipelined, seen = run()
    with ops.disabled("server_pipeline"):
        plain, seen_off = run()
    assert seen and not seen_off
    assert pipelined == plain
    finishes = [e for ev in pipelined for e in ev if e[0] == "finish"]
    assert len(finishes) == 7 and {e[2] for e in finishes} >= {"length"}


def test_pipeline_runs_through_rows_joining_and_leaving(tiny_dir, monkeypatch):
    """Greedy requests that join a running sequence and leave before it (no logits processors): every step after
    the first is fed the unread tokens of the step queued before it (the host's last tokens only for the rows that
    joined), and the text equals the unpipelined engine's."""
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.server.engine import Engine

    model, tok = lily_mlx.load(str(tiny_dir))
    specs = [("The long one, about foxes", 40), ("Joins, leaves first:", 9), ("Joins too, then leaves", 17)]
    from_host = []
    real = Engine._inputs
    monkeypatch.setattr(Engine, "_inputs", lambda self, q: from_host.append(q is None) or real(self, q))

    def after(i, engine, reqs, events):  # each joins the one running
        _wait_until(lambda: sum(e[0] == "delta" for e in events[0]) >= 3 + 4 * i, lambda: not reqs[0].finished)

    def run():
        from_host.clear()
        events, _ = _serve_greedy(model, tok, specs, after)
        return [[(e[0], *map(str, e[1:])) for e in ev] for ev in events], list(from_host)

    pipelined, host_inputs = run()
    assert host_inputs[0] and not any(host_inputs[1:]), host_inputs
    with ops.disabled("server_pipeline"):
        plain, host_inputs_off = run()
    assert all(host_inputs_off)
    assert pipelined == plain
    assert [e[2] for ev in pipelined for e in ev if e[0] == "finish"] == ["length"] * 3


def test_penalties_read_the_tokens_the_host_has_not_read(tiny_dir):
    """Greedy rows with repetition, presence and frequency penalties (favouring repeats, so a token the processors miss
    shows at once), pipelined or not, alone or as n=2 batched rows:
    the tokens equal lily_mlx.generate_step's with the same processors given the server's contexts (repetition: the
    last tokens of prompt and output; presence, frequency: the output only), EOS barred by logit_bias in both."""
    import lily_mlx
    import mlx.core as mx
    from mlx_lm.sample_utils import make_frequency_penalty, make_presence_penalty, make_repetition_penalty

    from lily_mlx import ops
    from lily_mlx.generation import generate_step
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))
    prompt, n_tokens = tok.encode("Penalties: the the the fox fox"), 24
    barred = {t: -100.0 for t in tok.eos_token_ids}
    params = dict(temperature=0, repetition_penalty=0.8, repetition_context_size=5, presence_penalty=-1.0,
                  frequency_penalty=-0.3, logprobs=True, logit_bias=barred)
    out_only = lambda proc: lambda h, logits: proc(h[len(prompt):], logits)  # noqa: E731
    bias = mx.zeros((model.config.vocab_size,)).at[mx.array(list(barred))].add(-100.0)
    procs = [lambda h, logits: logits + bias, make_repetition_penalty(0.8, 5),
             out_only(make_presence_penalty(-1.0, n_tokens)), out_only(make_frequency_penalty(-0.3, n_tokens))]
    want = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n_tokens, logits_processors=procs)]
    plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n_tokens, logits_processors=procs[:1])]
    assert want != plain and len(set(want)) < len(want)  # negative penalties: the output repeats itself

    def served(n):
        engine = Engine(lambda: (model, tok)).start()
        assert engine.ready.wait(30)
        events = []
        try:
            req = Request([prompt], [[]], [n_tokens], SamplingParams(n=n, **params),
                          [ChoiceOutput(tok, [], chat=False) for _ in range(n)], events.extend, 60)
            engine.submit(req)
            _wait_finished([req])
        finally:
            engine.stop()
        return [[lp.token for e in events if e[0] in ("delta", "finish") and e[1] == c
                 for lp in (e[2] if e[0] == "delta" else e[3]).logprobs] for c in range(n)]

    for pipelined in (True, False):
        with ops.switched("server_pipeline", pipelined):
            assert served(1) == [want], pipelined
            assert served(2) == [want, want], pipelined


def test_batched_prefill_gives_each_row_its_own_prefill(tiny_dir, monkeypatch):
    """Switch batched_prefill: prompts of different lengths queued together (one with n=2) prefill in one
    left-padded forward; every choice's greedy text equals the one-at-a-time prefill's, the rows' prompt ends are
    snapshotted into the prefix cache as a lone prefill's are, and a prompt with a snapshot inside it, one
    longer than --prefill-step, or one the prefix cache resumes, is prefilled alone."""
    import lily_mlx
    from lily_mlx import ops
    from lily_mlx.server.engine import Engine, Request
    from lily_mlx.server.output import ChoiceOutput
    from lily_mlx.server.prefix_cache import PrefixCache
    from lily_mlx.server.schema import SamplingParams

    model, tok = lily_mlx.load(str(tiny_dir))
    # 4, 8, 18 (n=2), 36 tokens (the padded 4 x 36 is past prefill_step), one with a snapshot inside, one past
    # prefill_step, the first again (resumed from its snapshot)
    texts = ["Foxes", "Models serve", "Two choices of this:", "A longer prompt about the habits of dogs and cats",
             "One with a snapshot inside it, at a message boundary",
             "A prompt longer than the prefill step of sixty-four tokens, so it is prefilled in chunks", "Foxes"]
    groups, real = [], Engine._prefill_together
    monkeypatch.setattr(Engine, "_prefill_together", lambda self, g: groups.append(len(g)) or real(self, g))

    def run():
        groups.clear()
        engine = Engine(lambda: (model, tok), prefix_cache=PrefixCache(1 << 30), prefill_step=64).start()
        assert engine.ready.wait(30)
        events, reqs = [[] for _ in texts], []
        try:
            with engine._cv:  # every request in the engine's next iteration
                for i, text in enumerate(texts):
                    ids = tok.encode(text)
                    snaps = [len(ids) - 1] + ([4] if i == 4 else [])
                    n = 2 if i == 2 else 1
                    req = Request([ids], [sorted(snaps)], [12], SamplingParams(temperature=0, n=n),
                                  [ChoiceOutput(tok, [], chat=False) for _ in range(n)], events[i].extend, 60)
                    reqs.append(req)
                    engine.submit(req)
            _wait_finished(reqs)
            snapped = [engine.prefix_cache.contains(tok.encode(t), len(tok.encode(t)) - 1) for t in texts]
        finally:
            engine.stop()
        per_choice = [[e for e in ev if e[0] in ("delta", "finish")] for ev in events]
        return ["".join(str(e[2]) for e in ev if e[0] == "delta") + str(ev[-1][1:]) for ev in per_choice], snapped

    with ops.switched("batched_prefill", False):
        alone, snapped_alone = run()
    assert groups == []
    with ops.switched("batched_prefill", True):
        together, snapped = run()
    assert groups == [3], groups  # the first three; the 36-token one then alone, as is every one after it
    assert together == alone and snapped == snapped_alone == [True] * len(texts)
