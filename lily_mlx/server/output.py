"""Generated tokens -> API text, per choice: detokenization, stop strings, reasoning / tool-call splitting.

Runs on the engine thread so a stop string ends generation at the token that completes it.
Reasoning (<think>...</think>) and tool calls are split with mlx-lm's TextStateMachine and parsed
with the tokenizer's mlx-lm tool parser.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Optional

from mlx_lm.generate import TextStateMachine, make_text_state_machine

log = logging.getLogger("lily_mlx.server")


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __bool__(self):
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)

    def extend(self, other: "Delta"):
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        self.logprobs += other.logprobs


class StopMatcher:
    """Finds the earliest stop string in streamed text, holding back any tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string completed)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for j in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:j]):
                    keep = j
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class ChoiceOutput:
    """One choice's text pipeline. chat=False (completions) keeps the raw text: no reasoning/tool split."""

    def __init__(self, tokenizer, stops: list[str], chat: bool, initial_state: str = "normal", tools=None):
        self.detok = tokenizer.detokenizer
        self.stop = StopMatcher(stops)
        self.tools = tools
        self.parser = tokenizer.tool_parser if chat and tokenizer.has_tool_calling else None
        self.sm: Optional[TextStateMachine] = make_text_state_machine(tokenizer) if chat else None
        self.state = self.sm.make_state(initial_state) if self.sm else None
        self.tool_text = ""
        self.made_tool_call = False
        self.start_marker = (tokenizer.tool_call_start or "") if chat else ""
        self.end_marker = (tokenizer.tool_call_end or "") if chat else ""

    def feed(self, token: int, logprob: Optional[TokenLogprob]) -> tuple[Delta, bool]:
        """Add one generated (non-EOS) token. -> (what to emit now, whether a stop string ended the text)."""
        self.detok.add_token(token)
        text, stopped = self.stop.feed(self.detok.last_segment)
        delta = self._route(text)
        if logprob is not None:
            delta.logprobs.append(logprob)
        return delta, stopped

    def finish(self, reason: str) -> Delta:
        """Flush what is held back. On a stop string the held tail is dropped (it was the stop's start)."""
        delta = Delta()
        if reason != "stop_string":
            self.detok.finalize()
            text, stopped = self.stop.feed(self.detok.last_segment)
            delta.extend(self._route(text))
            if not stopped:
                delta.extend(self._route(self.stop.flush()))
        if self.sm is not None:
            self.state, rest, name = TextStateMachine.flush(self.state)
            delta.extend(self._emit(name, rest))
            if self.tool_text:  # an unterminated tool call: keep its text rather than lose it
                delta.content += self.start_marker + self.tool_text
                self.tool_text = ""
        return delta

    def _route(self, text: str) -> Delta:
        if self.sm is None:
            return Delta(content=text)
        if not text:
            return Delta()
        self.state, segments = TextStateMachine.split(self.state, text)
        delta = Delta()
        for i, (name, seg) in enumerate(segments):
            delta.extend(self._emit(name, seg))
            if name == "tool" and i < len(segments) - 1:
                self._parse_tool(delta)
        return delta

    def _emit(self, name: Optional[str], text: str) -> Delta:
        if name == "reasoning":
            return Delta(reasoning=text)
        if name == "tool":
            self.tool_text += text
            return Delta()
        return Delta(content=text)

    def _parse_tool(self, delta: Delta) -> None:
        """A complete tool-call block -> delta.tool_calls; unparsable text stays content, markers included."""
        text, self.tool_text = self.tool_text, ""
        try:
            if self.parser is None:
                raise ValueError("the chat template has no tool-call parser")
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
            log.warning("unparsable tool call (%s: %s); returned as content", type(e).__name__, e)
            delta.content += self.start_marker + text + self.end_marker
            return
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            args = tc.get("arguments", {})
            delta.tool_calls.append({
                "id": tc.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": tc.get("name", ""),
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            })
            self.made_tool_call = True
