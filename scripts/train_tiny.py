"""Train the embedded default model, lily-tiny: a byte-level BPE tokenizer and a 2M-parameter Qwen3.5-MoE
(Gated DeltaNet + gated attention + 8-expert MoE) on CPython stdlib docstrings, on CPU, seeded.

    python scripts/train_tiny.py                  # tokenizer + model -> lily_mlx/assets/lily-tiny/
    python scripts/train_tiny.py --build-corpus   # first re-extract the corpus from this Python's stdlib

The corpus is shipped (lily_mlx/assets/corpus/), so a rerun does not depend on the local Python version.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "lily_mlx" / "assets" / "corpus" / "stdlib_docstrings.jsonl"
OUT = ROOT / "lily_mlx" / "assets" / "lily-tiny"

VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 keeps these as added but non-special tokens (they survive skip_special_tokens).
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2/3's pre-tokenizer split pattern.
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
VAL_EVERY = 20  # document i is held out when i % VAL_EVERY == 0
CHAT_FRACTION = 0.3  # named train docs also rendered as a chat turn, so the model learns <|im_end|>

TEXT_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_num_value_heads=4,
    linear_value_head_dim=48,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
# Tiny but present, so the file has the release's model.visual.* tensors (untrained: text only).
VISION_CONFIG = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=128, patch_size=4,
                     num_position_embeddings=64)

# Modelled on Qwen3's template: system/user/assistant/tool turns, tools, <think> blocks, enable_thinking.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

QUESTIONS = ["What does {name} do?", "Explain {name}.", "Describe `{name}` in the {module} module.", "Document {name}."]


def build_corpus(path: Path) -> None:
    """Docstrings (>= 80 chars, deduplicated) of this Python's stdlib, read with ast (nothing imported)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    packages = ["asyncio", "collections", "concurrent/futures", "ctypes", "curses", "dbm", "email", "html", "http",
                "importlib", "json", "logging", "multiprocessing", "re", "sqlite3", "tomllib", "unittest", "urllib",
                "venv", "wsgiref", "xml/etree", "xmlrpc", "zipfile", "zoneinfo"]
    files = sorted(stdlib.glob("*.py")) + sorted(p for d in packages for p in (stdlib / d).glob("*.py"))
    seen, records = set(), []

    def visit(node, module, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                add(ast.get_docstring(child), module, name)
                visit(child, module, name + ".")

    def add(doc, module, name):
        if doc and len(doc) >= 80 and doc not in seen:
            seen.add(doc)
            records.append({"module": module, "name": name, "doc": doc})

    for f in files:
        rel = f.relative_to(stdlib).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        tree = ast.parse(f.read_text(encoding="utf-8"))
        add(ast.get_docstring(tree), module, "")
        visit(tree, module, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for r in records:
            out.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"corpus: {len(records)} docstrings from {len(files)} files of Python {sys.version.split()[0]} -> {path}")


def read_corpus(path: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    val = [r for i, r in enumerate(records) if i % VAL_EVERY == 0]
    train = [r for i, r in enumerate(records) if i % VAL_EVERY]
    return train, val


def train_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL) - len(ADDED),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    decoder = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": t in SPECIAL}
        for t in SPECIAL + ADDED
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def render(records: list[dict], hf_tok, rng: random.Random, chat: bool) -> list[str]:
    """Plain docs end with <|endoftext|>; a CHAT_FRACTION of named ones become a Qwen chat turn instead."""
    out = []
    for r in records:
        if chat and r["name"] and rng.random() < CHAT_FRACTION:
            name = f"{r['module']}.{r['name']}"
            messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(name=name, module=r["module"])},
                        {"role": "assistant", "content": r["doc"]}]
            if rng.random() < 0.25:
                messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
            out.append(hf_tok.apply_chat_template(messages, tokenize=False))
        else:
            out.append(r["doc"] + "<|endoftext|>")
    return out


def windows(ids, T: int):
    import torch

    n = (len(ids) - 1) // T
    t = torch.tensor(ids[: n * T + 1])
    return torch.stack([t[i * T : i * T + T + 1] for i in range(n)])  # [n, T+1]


def mean_nll(model, rows, batch: int = 16) -> float:
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i : i + batch]
            logits = model(input_ids=x[:, :-1]).logits.float()  # [B, T, V]
            total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
    return total / count


def unigram_entropy(ids) -> float:
    from collections import Counter

    counts = Counter(ids)
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def write_card(out: Path, stats: dict) -> None:
    t = TEXT_CONFIG
    card = f"""# lily-tiny: the embedded default model of lily_mlx

A {stats['params'] / 1e6:.2f}M-parameter Qwen3.5-MoE (`qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`) trained
from scratch on CPU by `scripts/train_tiny.py`, so that lily_mlx has a real, trained checkpoint of the
architecture to run, test and benchmark on any machine. It writes docstring-like English and Python; it
knows nothing else.

## Shape
- hidden {t['hidden_size']}, {t['num_hidden_layers']} layers: {', '.join(t['layer_types'])}
- gated attention: {t['num_attention_heads']} query heads, {t['num_key_value_heads']} KV heads, head_dim {t['head_dim']},
  partial RoPE {t['rope_parameters']['partial_rotary_factor']} (theta {t['rope_parameters']['rope_theta']:g})
- Gated DeltaNet: {t['linear_num_key_heads']} key heads x {t['linear_key_head_dim']}, \
{t['linear_num_value_heads']} value heads x {t['linear_value_head_dim']}, conv width {t['linear_conv_kernel_dim']}
- MoE in every layer: {t['num_experts']} experts, top-{t['num_experts_per_tok']}, expert width {t['moe_intermediate_size']}, \
shared expert {t['shared_expert_intermediate_size']}
- vocab {t['vocab_size']} (byte-level BPE), untied lm_head, max_position_embeddings {t['max_position_embeddings']}
- a 1-block vision tower (`model.visual.*`, random, never trained) so the file has the release's layout

Weights: float32 safetensors in the HF release layout (`model.language_model.*`, fused
`mlp.experts.gate_up_proj` / `down_proj`, zero-centred RMSNorm weights, `lm_head.weight`). No MTP head.
It loads in lily_mlx (`lily_mlx.load("embedded")`), stock mlx-lm (`mlx_lm.load(path)`) and transformers.

## Tokenizer
Byte-level BPE trained with `tokenizers` on the training split (Qwen2's pre-tokenizer regex, NFC), plus
Qwen's special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and the non-special `<think>`,
`</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`. eos is `<|im_end|>`
(config.json lists both `<|im_end|>` and `<|endoftext|>`). The chat template is modelled on Qwen3's and
takes `enable_thinking` (false: the generation prompt ends in an empty `<think>\\n\\n</think>\\n\\n`).

## Data
`../corpus/stdlib_docstrings.jsonl`: CPython {stats['python']} standard-library docstrings (PSF licence, see
`../corpus/README.md`); docstring i is held out when i % {stats['val_every']} == 0. Training text is each docstring
followed by `<|endoftext|>`, with {CHAT_FRACTION:.0%} of the named ones instead rendered as a chat turn
(a question about the function, the docstring as the answer, ending in `<|im_end|>`).
{stats['train_tokens']} training tokens, {stats['val_tokens']} held-out tokens.

## Training
`{stats['command']}` (seed {stats['seed']}): AdamW (0.9, 0.95), weight decay 0.1, lr {stats['lr']:g} with
linear warm-up and cosine decay to 10%, {stats['steps']} steps of {stats['batch']} x {stats['seq']} tokens, router
load-balancing loss 0.001, grad clip 1.0; torch {stats['torch']} on {stats['threads']} CPU thread(s), {stats['train_seconds']} s
on a shared 2-core machine, {stats['date']}. Measured there between other jobs' bursts, a step
takes about 0.75 s on 2 threads and 1.8 s on 1, so the default 600 steps take 8-18 minutes.

## Losses (mean NLL, nats/token, of the saved weights)
| what | value |
| --- | --- |
| train (sample of 256-token windows) | {stats['train']:.3f} |
| held-out (all 256-token windows) | {stats['val']:.3f} |
| held-out, first 1024 tokens as one sequence | {stats['heldout_nll_first_1024']:.3f} |
| unigram entropy of the held-out tokens | {stats['val_unigram_entropy']:.3f} |

The run sees the training text {stats['steps'] * stats['batch'] * stats['seq'] / stats['train_tokens']:.1f} times; the gap between train and held-out
loss is memorisation, which is fine for a test model.
"""
    (out / "README.md").write_text(card)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-corpus", action="store_true", help="re-extract the corpus from this Python's stdlib first")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.set_num_threads(args.threads)
    if args.build_corpus:
        build_corpus(CORPUS)
    train_recs, val_recs = read_corpus(CORPUS)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer([r["doc"] for r in train_recs])
    save_tokenizer(tok, out)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    hf_tok.chat_template = CHAT_TEMPLATE

    rng = random.Random(args.seed)
    train_docs = [tok.encode(t).ids for t in render(train_recs, hf_tok, rng, chat=True)]
    val_ids = [i for t in render(val_recs, hf_tok, rng, chat=False) for i in tok.encode(t).ids]
    val_rows = windows(val_ids, args.seq)
    n_train = sum(map(len, train_docs))
    print(f"tokens: train {n_train}, val {len(val_ids)}; corpus bytes/token "
          f"{sum(len(r['doc'].encode()) for r in train_recs) / n_train:.2f}")

    torch.manual_seed(args.seed)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    text = dict(TEXT_CONFIG, eos_token_id=eos[0], pad_token_id=eos[1], bos_token_id=None)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=VISION_CONFIG, tie_word_embeddings=False)
    model = Qwen3_5MoeForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def epoch_rows(epoch):
        order = list(range(len(train_docs)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        rows = windows([i for j in order for i in train_docs[j]], args.seq)
        return rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(epoch))]

    model.train()
    start, epoch, rows, pos, recent = time.time(), 0, epoch_rows(0), 0, []
    for step in range(args.steps):
        if pos + args.batch > len(rows):
            epoch, pos = epoch + 1, 0
            rows = epoch_rows(epoch)
        x = rows[pos : pos + args.batch]
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out_ = model(input_ids=x[:, :-1], output_router_logits=True)  # logits [B, T, V]
        loss = F.cross_entropy(out_.logits.flatten(0, 1), x[:, 1:].flatten())
        loss = loss + cfg.text_config.router_aux_loss_coef * out_.aux_loss  # keeps all experts in use
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d} epoch {epoch} loss {sum(recent) / len(recent):.3f} lr {lr_at(step):.2e} "
                  f"{time.time() - start:.0f}s", flush=True)
    train_seconds = time.time() - start

    model.eval()
    train_rows = epoch_rows(10_000)[: len(val_rows)]
    losses = {"train": mean_nll(model, train_rows), "val": mean_nll(model, val_rows)}
    losses["val_unigram_entropy"] = unigram_entropy(val_ids)
    # One 1024-token sequence of the held-out stream: what tests/test_embedded.py recomputes in MLX.
    losses["heldout_nll_first_1024"] = mean_nll(model, torch.tensor([val_ids[:1024]]))
    print(f"mean NLL: train {losses['train']:.3f}, val {losses['val']:.3f}; "
          f"unigram entropy {losses['val_unigram_entropy']:.3f} nats/token")

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    config = json.loads(cfg.to_json_string(use_diff=False))
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], eos_token_id=eos, dtype="float32")
    config["text_config"]["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    command = " ".join(["python", "scripts/train_tiny.py"] + sys.argv[1:])
    stats = dict(losses, val_every=VAL_EVERY, command=command, threads=args.threads, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                 train_tokens=n_train, val_tokens=len(val_ids), train_seconds=round(train_seconds),
                 params=sum(p.numel() for p in model.parameters()), date=datetime.date.today().isoformat(),
                 torch=torch.__version__, python=sys.version.split()[0])
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_card(out, stats)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
