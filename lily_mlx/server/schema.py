"""Request validation for the OpenAI-style endpoints: every field type- and range-checked, errors naming the field.

Parsing never touches the model: vocabulary-dependent checks (logit_bias ids, token-id prompts) take
the vocabulary size as an argument. Errors are BadRequest, rendered as OpenAI's error object.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted for compatibility and ignored: they do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


class APIError(Exception):
    """An error answered as OpenAI's object {"error": {message, type, param, code}}."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; NaN/Infinity literals and non-object bodies are refused."""
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {_kind(body)}")
    return body


class Fields:
    """Typed access to one JSON object's fields; unknown keys are refused up front."""

    def __init__(self, obj: dict, allowed: set[str], where: str = "", ignored: frozenset[str] = frozenset()):
        self.obj, self.where = obj, where
        unknown = sorted(set(obj) - allowed - ignored)
        if unknown:
            raise BadRequest(f"unrecognized argument supplied: {self.name(unknown[0])}", param=self.name(unknown[0]))

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str):
        return self.obj.get(key)

    def _fail(self, key: str, expected: str, value: Any):
        raise BadRequest(f"'{self.name(key)}' must be {expected}, got {_kind(value)} {_short(value)}", param=self.name(key))

    def number(self, key, default, lo=None, hi=None, lo_open=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self._fail(key, "a number", v)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo}"
            hi_s = "" if hi is None else f"<= {hi}"
            raise BadRequest(f"'{self.name(key)}' must be {' and '.join(s for s in (lo_s, hi_s) if s)}, got {v}", param=self.name(key))
        return float(v)

    def integer(self, key, default, lo=None, hi=None):
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            self._fail(key, "an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
            raise BadRequest(f"'{self.name(key)}' must be {rng}, got {v}", param=self.name(key))
        return v

    def boolean(self, key, default):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self._fail(key, "a boolean", v)
        return v

    def string(self, key, default, choices=None, nonempty=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            self._fail(key, "a string", v)
        if choices is not None and v not in choices:
            raise BadRequest(f"'{self.name(key)}' must be one of {list(choices)}, got {v!r}", param=self.name(key))
        if nonempty and not v:
            raise BadRequest(f"'{self.name(key)}' must not be empty", param=self.name(key))
        return v

    def object(self, key, default):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, dict):
            self._fail(key, "an object", v)
        return v

    def array(self, key, default, nonempty=False):
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, list):
            self._fail(key, "an array", v)
        if nonempty and not v:
            raise BadRequest(f"'{self.name(key)}' must not be empty", param=self.name(key))
        return v


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    max_tokens: Optional[int] = None  # None: up to the context / server limit
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_p == 0.0 or self.top_k == 1


@dataclass
class ChatRequest:
    model: Optional[str]
    messages: list[dict]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tools: Optional[list[dict]]
    template_kwargs: dict


@dataclass
class CompletionRequest:
    model: Optional[str]
    prompts: list  # list[str] or list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool


SAMPLING_FIELDS = {
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
    "logit_bias", "stream", "stream_options",
}
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "chat_template_kwargs", "response_format",
}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}


def _sampling(f: Fields, vocab_size: int, max_tokens_key: str = "max_tokens") -> SamplingParams:
    p = SamplingParams()
    f.string("model", None)
    p.temperature = f.number("temperature", 1.0, 0.0, 2.0)
    p.top_p = f.number("top_p", 1.0, 0.0, 1.0)
    p.top_k = f.integer("top_k", 0, -1)
    p.top_k = 0 if p.top_k in (-1, 0) or p.top_k >= vocab_size else p.top_k
    p.min_p = f.number("min_p", 0.0, 0.0, 1.0)
    p.seed = f.integer("seed", None, -(2**63), 2**64 - 1)
    p.n = f.integer("n", 1, 1, MAX_N)
    p.presence_penalty = f.number("presence_penalty", 0.0, -2.0, 2.0)
    p.frequency_penalty = f.number("frequency_penalty", 0.0, -2.0, 2.0)
    p.repetition_penalty = f.number("repetition_penalty", 1.0, 0.0, 100.0, lo_open=True)
    p.repetition_context_size = f.integer("repetition_context_size", 20, 1, 1 << 20)
    p.max_tokens = f.integer(max_tokens_key, None, 1)
    p.stop = _stop(f)
    p.logit_bias = _logit_bias(f, vocab_size)
    return p


def _stop(f: Fields) -> list[str]:
    v = f.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        f._fail("stop", "a string or an array of strings", v)
    if len(items) > MAX_STOP:
        raise BadRequest(f"'stop' has {len(items)} entries; at most {MAX_STOP} are allowed", param="stop")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise BadRequest(f"'stop[{i}]' must be a string, got {_kind(s)} {_short(s)}", param="stop")
        if not s:
            raise BadRequest(f"'stop[{i}]' must not be an empty string", param="stop")
    return list(dict.fromkeys(items))


def _logit_bias(f: Fields, vocab_size: int) -> dict[int, float]:
    v = f.object("logit_bias", {})
    if len(v) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed", param="logit_bias")
    out = {}
    for k, b in v.items():
        if not re.fullmatch(r"\d+", k):
            raise BadRequest(f"'logit_bias' key {k!r} is not a token id (a non-negative integer)", param="logit_bias")
        tid = int(k)
        if tid >= vocab_size:
            raise BadRequest(
                f"'logit_bias' token id {tid} is out of range: the vocabulary has {vocab_size} tokens (0..{vocab_size - 1})",
                param="logit_bias",
            )
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise BadRequest(f"'logit_bias[{k}]' must be a number between -100 and 100, got {_short(b)}", param="logit_bias")
        out[tid] = float(b)
    return out


def _stream(f: Fields) -> tuple[bool, bool]:
    stream = f.boolean("stream", False)
    opts = f.object("stream_options", None)
    if opts is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return stream, Fields(opts, {"include_usage"}, "stream_options").boolean("include_usage", False)


def parse_chat(body: dict, vocab_size: int) -> ChatRequest:
    f = Fields(body, CHAT_FIELDS, ignored=IGNORED_FIELDS)
    if "messages" not in body:
        raise BadRequest("'messages' is required", param="messages")
    messages = [_message(m, i) for i, m in enumerate(f.array("messages", None, nonempty=True))]
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        p = _sampling(f, vocab_size, "max_completion_tokens")
        f.integer("max_tokens", None, 1)
    else:
        p = _sampling(f, vocab_size)
    p.logprobs = f.boolean("logprobs", False)
    p.top_logprobs = f.integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if p.top_logprobs and not p.logprobs:
        raise BadRequest("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    stream, usage = _stream(f)
    tools = _tools(f)
    choice = f.get("tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise BadRequest(f"'tool_choice' must be 'none', 'auto', 'required' or an object, got {choice!r}", param="tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        raise BadRequest("'tool_choice' other than 'auto' or 'none' is not supported by this server", param="tool_choice")
    if choice == "none":
        tools = None
    fmt = f.object("response_format", None)
    if fmt is not None and fmt.get("type") != "text":
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported by this server", param="response_format")
    kwargs = f.object("chat_template_kwargs", {})
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise BadRequest("'chat_template_kwargs.enable_thinking' must be a boolean", param="chat_template_kwargs.enable_thinking")
    return ChatRequest(body.get("model"), messages, p, stream, usage, tools, dict(kwargs))


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"}


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"'{where}' must be an object, got {_kind(m)} {_short(m)}", param=where)
    f = Fields(m, MESSAGE_FIELDS, where)
    if "role" not in m:
        raise BadRequest(f"'{where}.role' is required", param=f"{where}.role")
    role = f.string("role", None, choices=ROLES)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if content is None:
        if role not in ("assistant",):
            raise BadRequest(f"'{where}.content' is required for role '{role}'", param=f"{where}.content")
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    elif not isinstance(content, str):
        f._fail("content", "a string or an array of text parts", content)
    out["content"] = content
    if (name := f.string("name", None)) is not None:
        out["name"] = name
    if (rc := f.string("reasoning_content", None)) is not None:
        out["reasoning_content"] = rc
    f.string("refusal", None)
    calls = f.array("tool_calls", None)
    if calls is not None:
        if role != "assistant":
            raise BadRequest(f"'{where}.tool_calls' is only allowed on assistant messages", param=f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if (tcid := f.string("tool_call_id", None)) is not None:
        out["tool_call_id"] = tcid
    return out


def _text_part(p: Any, where: str) -> str:
    if not isinstance(p, dict):
        raise BadRequest(f"'{where}' must be an object, got {_kind(p)}", param=where)
    if p.get("type") != "text":
        raise BadRequest(f"'{where}.type' {p.get('type')!r} is not supported: this model takes text parts only", param=f"{where}.type")
    text = Fields(p, {"type", "text"}, where).string("text", None)
    if text is None:
        raise BadRequest(f"'{where}.text' is required for a text part", param=f"{where}.text")
    return text


def _tool_call(c: Any, where: str) -> dict:
    if not isinstance(c, dict):
        raise BadRequest(f"'{where}' must be an object, got {_kind(c)}", param=where)
    f = Fields(c, {"id", "type", "function", "index"}, where)
    f.string("type", "function", choices=("function",))
    fn = f.object("function", None)
    if fn is None:
        raise BadRequest(f"'{where}.function' is required", param=f"{where}.function")
    g = Fields(fn, {"name", "arguments"}, f"{where}.function")
    name = g.string("name", None, nonempty=True)
    if name is None:
        raise BadRequest(f"'{where}.function.name' is required", param=f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise BadRequest(f"'{where}.function.arguments' is not valid JSON: {e}", param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise BadRequest(f"'{where}.function.arguments' must encode a JSON object", param=f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if (cid := f.string("id", None)) is not None:
        out["id"] = cid
    return out


def _tools(f: Fields) -> Optional[list[dict]]:
    tools = f.array("tools", None)
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"'{where}' must be an object, got {_kind(t)}", param=where)
        tf = Fields(t, {"type", "function"}, where)
        tf.string("type", "function", choices=("function",))
        fn = tf.object("function", None)
        if fn is None:
            raise BadRequest(f"'{where}.function' is required", param=f"{where}.function")
        g = Fields(fn, {"name", "description", "parameters", "strict"}, f"{where}.function")
        if g.string("name", None, nonempty=True) is None:
            raise BadRequest(f"'{where}.function.name' is required", param=f"{where}.function.name")
        g.string("description", None)
        g.object("parameters", None)
        g.boolean("strict", None)
        out.append({"type": "function", "function": fn})
    return out or None


def parse_completion(body: dict, vocab_size: int) -> CompletionRequest:
    f = Fields(body, COMPLETION_FIELDS, ignored=IGNORED_FIELDS)
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", param="prompt")
    prompts = _prompts(body["prompt"], vocab_size)
    p = _sampling(f, vocab_size)
    if p.max_tokens is None:
        p.max_tokens = 16  # OpenAI's default for /v1/completions
    n_lp = f.integer("logprobs", None, 0, MAX_TOP_LOGPROBS)
    p.logprobs, p.top_logprobs = n_lp is not None, n_lp or 0
    echo = f.boolean("echo", False)
    if echo and p.logprobs:
        raise BadRequest("'echo' together with 'logprobs' (prompt logprobs) is not supported by this server", param="echo")
    if f.string("suffix", None):
        raise BadRequest("'suffix' (insertion) is not supported by this server", param="suffix")
    best_of = f.integer("best_of", None, 1, MAX_N)
    if best_of is not None and best_of != p.n:
        raise BadRequest("'best_of' other than equal to 'n' is not supported by this server", param="best_of")
    stream, usage = _stream(f)
    return CompletionRequest(body.get("model"), prompts, p, stream, usage, echo)


def _prompts(v: Any, vocab_size: int) -> list:
    """string | [string] | [int] | [[int]] -> list of strings or list of token-id lists."""
    if isinstance(v, str):
        v = [v]
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise BadRequest(
            f"'prompt' must be a string, an array of strings, an array of token ids or an array of those, got {_kind(v)} {_short(v)}",
            param="prompt",
        )
    if len(v) > MAX_N:
        raise BadRequest(f"'prompt' has {len(v)} prompts; at most {MAX_N} are allowed per request", param="prompt")
    if all(isinstance(s, str) for s in v):
        for i, s in enumerate(v):
            if not s:
                raise BadRequest(f"'prompt[{i}]' is an empty string", param="prompt")
        return v
    for i, ids in enumerate(v):
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(
                f"'prompt[{i}]' must be a non-empty array of token ids (all prompts of one kind), got {_kind(ids)} {_short(ids)}",
                param="prompt",
            )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(f"'prompt[{i}]' holds token id {bad}, outside the vocabulary (0..{vocab_size - 1})", param="prompt")
    return v
