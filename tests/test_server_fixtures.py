"""A tiny servable checkpoint for the server tests and bench/serve_load.py: tests/tiny.py's random model plus
a byte-level BPE tokenizer trained here (vocab 400 <= the model's 512) and a small Qwen3-style chat template
with thinking and qwen3_coder-style tool calls (so mlx-lm infers its qwen3_coder tool parser)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call a tool as:\n<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "user assistant system tool function parameter weather city",
    "1234567890 + - * / = ( ) [ ] { } < > \" ' : ; ,",
    "Once upon a time there was a tiny model that served requests.",
]


def write_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    import tiny

    return tiny.write_tokenizer(path, vocab_size, corpus=CORPUS * 20, chat_template=CHAT_TEMPLATE)


def build_tiny_checkpoint(path: Path) -> Path:
    """tests/tiny.py's HF-layout random model (float32) + the tokenizer above, ready for `lily-mlx serve`."""
    import tiny

    tiny.write_hf(tiny.hf_model(), path)
    write_tokenizer(path)
    return path
