"""Train the embedded default model, lily-tiny: a byte-level BPE tokenizer and a 2M-parameter Qwen3.5-MoE
(Gated DeltaNet + gated attention + 8-expert MoE + a multi-token-prediction head) on CPython stdlib
docstrings, on CPU, seeded; then package it in the HF release layout (bf16, with `mtp.*`) and the MLX
4-bit layout.

    python scripts/train_tiny.py                  # tokenizer + model -> lily_mlx/assets/lily-tiny{,-4bit}/
    python scripts/train_tiny.py --package-only   # redo the 4-bit copy, samples and cards from the saved weights
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
import shutil
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "lily_mlx" / "assets" / "corpus" / "stdlib_docstrings.jsonl"
OUT = ROOT / "lily_mlx" / "assets" / "lily-tiny"
QUANT = {"bits": 4, "group_size": 64}  # the MLX layout's quantization (8-bit router and shared-expert gate)

VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 keeps these as added but non-special tokens (they survive skip_special_tokens).
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2/3's pre-tokenizer split pattern.
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
VAL_EVERY = 20  # document i is held out when i % VAL_EVERY == 0
CHAT_FRACTION = 0.3  # named train docs also rendered as a chat turn, so the model learns <|im_end|>
THINK_FRACTION = 0.5  # of those chat turns, the share with a (synthetic, one-line) reasoning block
MTP_WEIGHT = 0.3  # MTP loss weight in the joint loss (DeepSeek-V3 uses 0.3 early in training)

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
    # As in the Qwen3.5/3.6 releases' config.json: one MTP layer, sharing embed_tokens and lm_head.
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
)
# Tiny but present, so the file has the release's model.visual.* tensors (untrained: text only).
VISION_CONFIG = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=128, patch_size=4,
                     num_position_embeddings=64)

# Modelled on Qwen3.6's template: system/user/assistant/tool turns, XML tool calls, <think> blocks, enable_thinking
# (off: the generation prompt ends in an empty think block) and preserve_thinking (see the comment inside).
CHAT_TEMPLATE = r"""{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if item.type == 'text' or (item.type is not defined and 'text' in item) %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('lily-tiny reads text only; got a content part of type ' ~ item.type) }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {{- '\n\n' + render_content(messages[0].content)|trim }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content)|trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{#- Unlike Qwen3.6 (which keeps only the reasoning after the last user turn unless preserve_thinking is true),
    history keeps its <think> blocks unless preserve_thinking is false, so each turn's prompt is a token prefix
    of the next one. #}
{%- set keep_thinking = preserve_thinking is not defined or preserve_thinking is not false %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if keep_thinking or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {{- ('\n\n' if content else '') + '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is mapping %}
                    {%- for args_name in tool_call.arguments %}
                        {%- set args_value = tool_call.arguments[args_name] %}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- '<parameter=' + args_name + '>\n' + args_value + '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""

QUESTIONS = ["What does {name} do?", "Explain {name}.", "Describe `{name}` in the {module} module.", "Document {name}."]
REASONS = ["The question is about {name} in the {module} module.", "{name} is part of {module}; its docstring answers this.",
           "The user wants the documentation of {name}."]


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
    """Plain docs end with <|endoftext|>; a CHAT_FRACTION of named ones become a Qwen chat turn instead, half of
    them with a one-line reasoning block (so both enable_thinking modes continue text the model has seen)."""
    out = []
    for r in records:
        if chat and r["name"] and rng.random() < CHAT_FRACTION:
            name = f"{r['module']}.{r['name']}"
            reply = {"role": "assistant", "content": r["doc"]}
            if rng.random() < THINK_FRACTION:
                reply["reasoning_content"] = rng.choice(REASONS).format(name=name, module=r["module"])
            messages = [{"role": "user", "content": rng.choice(QUESTIONS).format(name=name, module=r["module"])}, reply]
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


def make_mtp(text_cfg):
    """The release's MTP head as a torch module, keys as in the checkpoint (`mtp.*`): fc [H, 2H], the two
    pre-fc norms, one full-attention MoE decoder layer, a final norm; embed_tokens and lm_head are shared."""
    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    H, eps = text_cfg.hidden_size, text_cfg.rms_norm_eps
    mtp = torch.nn.Module()
    mtp.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(H, eps)
    mtp.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(H, eps)
    mtp.fc = torch.nn.Linear(2 * H, H, bias=False)
    full = text_cfg.layer_types.index("full_attention")  # the layer index only picks the layer kind here
    mtp.layers = torch.nn.ModuleList([Qwen3_5MoeDecoderLayer(text_cfg, full) for _ in range(text_cfg.mtp_num_hidden_layers)])
    mtp.norm = Qwen3_5MoeRMSNorm(H, eps)
    with torch.no_grad():  # as the main model's init: zero-centred norms (the only 1-D tensors) at 0, the rest N(0, 0.02)
        for p in mtp.parameters():
            p.zero_() if p.dim() == 1 else p.normal_(0.0, text_cfg.initializer_range)
    return mtp


def mtp_forward(model, mtp, hidden, next_ids, router_logits=None):
    """MTP logits for token t+2 from hidden [B, L, H] (the main model's output after its final norm at t, the
    tensor lm_head scores, as vLLM feeds Qwen3-Next's head) and next_ids [B, L] (token t+1).
    Concatenation order [norm(embed(t+1)) | norm(h_t)]; causal attention over the L positions."""
    import torch

    if model.config.text_config._attn_implementation != "sdpa":  # only SDPA makes a mask-less call causal
        raise RuntimeError(f"the MTP layer needs SDPA attention, got {model.config.text_config._attn_implementation!r}")
    lm = model.model.language_model
    h = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(lm.embed_tokens(next_ids)), mtp.pre_fc_norm_hidden(hidden)], -1))
    pos = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
    rope = lm.rotary_emb(h, pos)  # RoPE is relative, so positions may start at 0 (lily_mlx's MTP cache does)
    for layer in mtp.layers:
        hook = None
        if router_logits is not None:
            hook = layer.mlp.gate.register_forward_hook(lambda m, i, o: router_logits.append(o[0]))
        h = layer(h, position_embeddings=rope, attention_mask=None)  # no mask: SDPA runs causal
        if hook is not None:
            hook.remove()
    return model.lm_head(mtp.norm(h))


def forward(model, mtp, x, router_logits=None):
    """x [B, T+1] -> (main logits [B, T, V] for x[:, 1:], MTP logits [B, T-1, V] for x[:, 2:])."""
    out = model.model(input_ids=x[:, :-1], output_router_logits=router_logits is not None)
    h = out.last_hidden_state  # after the final norm
    if router_logits is not None:
        router_logits.append(out.router_logits)
    return model.lm_head(h), mtp_forward(model, mtp, h[:, :-1], x[:, 1:-1], router_logits)


def evaluate(model, mtp, rows, batch: int = 16) -> dict:
    """Mean NLL (nats/token) of the main model and the MTP head, their top-1 accuracies, and MTP acceptance:
    how often the MTP argmax for token t+2 equals the main model's argmax for t+2 given the true tokens
    through t+1 (a greedy self-speculative draft of one token is accepted exactly then)."""
    import torch
    import torch.nn.functional as F

    s = dict.fromkeys(["nll", "mtp_nll", "top1", "mtp_top1", "mtp_acceptance"], 0.0)
    n = m = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            x = rows[i : i + batch]
            logits, mlog = (t.float() for t in forward(model, mtp, x))
            s["nll"] += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
            s["mtp_nll"] += F.cross_entropy(mlog.flatten(0, 1), x[:, 2:].flatten(), reduction="sum").item()
            greedy, draft = logits.argmax(-1), mlog.argmax(-1)
            s["top1"] += (greedy == x[:, 1:]).sum().item()
            s["mtp_top1"] += (draft == x[:, 2:]).sum().item()
            s["mtp_acceptance"] += (draft == greedy[:, 1:]).sum().item()
            n, m = n + x[:, 1:].numel(), m + x[:, 2:].numel()
    return {k: v / (n if k in ("nll", "top1") else m) for k, v in s.items()}


def unigram_entropy(ids) -> float:
    from collections import Counter

    counts = Counter(ids)
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in counts.values())


# Kept in float32 as the Qwen3.5 releases keep them (the DeltaNet decay and output-norm weights); the rest is bf16.
FP32_TENSORS = (".linear_attn.A_log", ".linear_attn.norm.weight")


def shipped_state(model, mtp) -> dict:
    """The checkpoint: HF release layout (model.language_model.*, model.visual.*, lm_head, mtp.*), bf16."""
    import torch

    state = dict(model.state_dict())
    state.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    return {k: v.detach().to(torch.float32 if k.endswith(FP32_TENSORS) else torch.bfloat16).contiguous()
            for k, v in state.items()}


def train(args, out: Path) -> dict:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    torch.set_num_threads(args.threads)
    train_recs, val_recs = read_corpus(CORPUS)
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
    tcfg = cfg.text_config
    mtp = make_mtp(tcfg)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
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

    model.train(), mtp.train()
    start, epoch, rows, pos, recent = time.time(), 0, epoch_rows(0), 0, []
    for step in range(args.steps):
        if pos + args.batch > len(rows):
            epoch, pos = epoch + 1, 0
            rows = epoch_rows(epoch)
        x = rows[pos : pos + args.batch]
        pos += args.batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        router = []
        logits, mlog = forward(model, mtp, x, router)  # [B, T, V], [B, T-1, V]
        loss_main = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss_mtp = F.cross_entropy(mlog.flatten(0, 1), x[:, 2:].flatten())
        # Load balancing keeps all experts in use; the MTP layer sees one token fewer, so it has its own term.
        aux = load_balancing_loss_func(router[0], tcfg.num_experts, tcfg.num_experts_per_tok) + \
            load_balancing_loss_func(tuple(router[1:]), tcfg.num_experts, tcfg.num_experts_per_tok)
        loss = loss_main + MTP_WEIGHT * loss_mtp + tcfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        recent = (recent + [(loss_main.item(), loss_mtp.item())])[-20:]
        if step % 50 == 0 or step == args.steps - 1:
            lm, lt = (sum(r[i] for r in recent) / len(recent) for i in (0, 1))
            print(f"step {step:4d} epoch {epoch} loss {lm:.3f} mtp {lt:.3f} lr {lr_at(step):.2e} "
                  f"{time.time() - start:.0f}s", flush=True)
    train_seconds = time.time() - start

    model.eval(), mtp.eval()
    fp32_val = evaluate(model, mtp, val_rows)["nll"]
    state = shipped_state(model, mtp)
    # Every statistic below is of the shipped (bf16-rounded) weights, computed in float32.
    model.load_state_dict({k: v.float() for k, v in state.items() if not k.startswith("mtp.")})
    mtp.load_state_dict({k[4:]: v.float() for k, v in state.items() if k.startswith("mtp.")})
    val = evaluate(model, mtp, val_rows)
    first = evaluate(model, mtp, torch.tensor([val_ids[:1024]]))  # what tests/test_embedded.py recomputes in MLX
    stats = {
        "train": evaluate(model, mtp, epoch_rows(10_000)[: len(val_rows)])["nll"],
        "val": val["nll"], "val_fp32_weights": fp32_val, "val_unigram_entropy": unigram_entropy(val_ids),
        "val_top1": val["top1"], "val_mtp_nll": val["mtp_nll"], "val_mtp_top1": val["mtp_top1"],
        "val_mtp_acceptance": val["mtp_acceptance"],
        "heldout_nll_first_1024": first["nll"], "heldout_mtp_acceptance_first_1024": first["mtp_acceptance"],
    }
    print(f"mean NLL: train {stats['train']:.3f}, val {val['nll']:.3f} (float32 weights {fp32_val:.3f}); "
          f"MTP val NLL {val['mtp_nll']:.3f}, acceptance {val['mtp_acceptance']:.3f}")

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    config = json.loads(cfg.to_json_string(use_diff=False))
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], eos_token_id=eos, dtype="bfloat16")
    config["text_config"]["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"eos_token_id": eos, "pad_token_id": eos[1], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    command = " ".join(["python", "scripts/train_tiny.py"] + sys.argv[1:])
    stats.update(val_every=VAL_EVERY, command=command, threads=args.threads, steps=args.steps, batch=args.batch,
                 seq=args.seq, lr=args.lr, seed=args.seed, mtp_weight=MTP_WEIGHT,
                 router_aux_loss_coef=tcfg.router_aux_loss_coef, train_tokens=n_train,
                 val_tokens=len(val_ids), train_seconds=round(train_seconds),
                 params=sum(p.numel() for p in model.parameters()), mtp_params=sum(p.numel() for p in mtp.parameters()),
                 date=datetime.date.today().isoformat(), torch=torch.__version__, python=sys.version.split()[0])
    return stats


def heldout_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the held-out stream (each held-out docstring + <|endoftext|>), as training renders it."""
    _, val_recs = read_corpus(CORPUS)
    ids = []
    for r in val_recs:
        ids += tokenizer.encode(r["doc"] + "<|endoftext|>")
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"the held-out split has fewer than {n} tokens")


def mlx_heldout(model, ids) -> dict:
    """Held-out NLL and MTP acceptance (as `evaluate` defines them) of a lily_mlx model, one sequence."""
    import mlx.core as mx

    x = mx.array([ids])
    hidden = model.language_model.model(x[:, :-1])  # after the final norm
    logits = model.language_model.logits(hidden).astype(mx.float32)[0]
    draft = model.mtp_logits(hidden[:, :-1], x[:, 1:-1]).astype(mx.float32)[0]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, x[0, 1:, None], axis=-1).mean().item()
    accept = (draft.argmax(-1) == logits.argmax(-1)[1:]).astype(mx.float32).mean().item()
    return {"nll": nll, "mtp_acceptance": accept}


SAMPLE_PROMPTS = [  # (label, prompt text, chat template kwargs or None for a raw prompt)
    ("code", "def fibonacci(", None),
    ("docstring", "Return a new list", None),
    ("chat, thinking off", "What does json.dumps do?", {"enable_thinking": False}),
    ("chat, thinking on", "Explain os.path.join.", {"enable_thinking": True}),
]


def samples(path: Path) -> list[tuple[str, str, str]]:
    """Greedy completions (up to 64 tokens, stopping at EOS) by lily_mlx: (label, prompt, completion)."""
    import lily_mlx

    model, tok = lily_mlx.load(str(path))
    out = []
    for label, text, kwargs in SAMPLE_PROMPTS:
        prompt = text if kwargs is None else tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, **kwargs)
        ids = tok.encode(prompt, add_special_tokens=False)
        out.append((label, prompt, lily_mlx.generate(model, tok, ids, max_tokens=64)))
    return out


def package(out: Path, stats: dict) -> dict:
    """The MLX 4-bit copy (lily_mlx's converter), lily_mlx's measurements of both layouts, and the cards."""
    import mlx.core as mx

    sys.path.insert(0, str(ROOT))
    import lily_mlx
    from lily_mlx.convert import convert

    out4 = out.parent / (out.name + "-4bit")
    if out4.exists():
        shutil.rmtree(out4)
    convert(str(out), str(out4), quantize=True, q_group_size=QUANT["group_size"], q_bits=QUANT["bits"])
    for name in ("README.md", "training.json"):
        (out4 / name).unlink(missing_ok=True)
    model, tok = lily_mlx.load(str(out))
    ids = heldout_ids(tok, 1024)
    for tag, kwargs in (("bf16", {}), ("float32", {"dtype": mx.float32})):
        m, _ = lily_mlx.load_model(out, **kwargs)
        r = mlx_heldout(m, ids)
        stats[f"lily_{tag}_heldout_nll_first_1024"], stats[f"lily_{tag}_heldout_mtp_acceptance_first_1024"] = r["nll"], r["mtp_acceptance"]
    m4, _ = lily_mlx.load_model(out4)
    r = mlx_heldout(m4, ids)
    stats["lily_4bit_heldout_nll_first_1024"], stats["lily_4bit_heldout_mtp_acceptance_first_1024"] = r["nll"], r["mtp_acceptance"]
    stats["bytes_hf_bf16"] = sum(f.stat().st_size for f in out.iterdir())
    stats["bytes_mlx_4bit"] = sum(f.stat().st_size for f in out4.iterdir())
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_card(out, stats, samples(out), samples(out4))
    (out4 / "README.md").write_text(
        f"# lily-tiny-4bit\n\n`../lily-tiny` (see its README.md, the model card) in the MLX layout, affine 4-bit "
        f"(group {QUANT['group_size']}; router and shared-expert gate 8-bit), `mtp.*` included, written by "
        f"`lily_mlx.convert` from the bf16 weights. lily_mlx loads it as `\"embedded-4bit\"`.\n\n"
        f"Held-out NLL (first 1024 tokens, lily_mlx): {stats['lily_4bit_heldout_nll_first_1024']:.3f} nats/token "
        f"(bf16 weights: {stats['lily_bf16_heldout_nll_first_1024']:.3f}); MTP acceptance on the same text: "
        f"{stats['lily_4bit_heldout_mtp_acceptance_first_1024']:.1%}.\n")
    return stats


def write_card(out: Path, stats: dict, bf16_samples, q4_samples) -> None:
    t = TEXT_CONFIG
    ppl = math.exp(stats["val"])

    def sample_block(rows):
        return "\n".join(f"- {label}: `{prompt!r}` ->\n  `{text!r}`" for label, prompt, text in rows)

    card = f"""# lily-tiny: the embedded default model of lily_mlx

A {stats['params'] / 1e6:.2f}M-parameter Qwen3.5-MoE (`qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`) with a
{stats['mtp_params'] / 1e6:.2f}M-parameter multi-token-prediction (MTP) head, trained from scratch on CPU by
`scripts/train_tiny.py`, so that lily_mlx has a real, trained checkpoint of the architecture to run, test
and benchmark on any machine. It writes docstring-like English and Python; it knows nothing else.

## Layouts shipped
| folder | layout | size | loads in |
| --- | --- | --- | --- |
| `lily-tiny` (`"embedded"`) | HF release layout, bf16 (DeltaNet `A_log` and output-norm weight float32, as the Qwen3.5 releases), with `mtp.*` and a random 1-block vision tower | {stats['bytes_hf_bf16'] / 1e6:.1f} MB | lily_mlx, stock mlx-lm, transformers |
| `lily-tiny-4bit` (`"embedded-4bit"`) | MLX layout, affine 4-bit, group {QUANT['group_size']}, router and shared-expert gate 8-bit, with `mtp.*` | {stats['bytes_mlx_4bit'] / 1e6:.1f} MB | lily_mlx, stock mlx-lm |

HF layout: `model.language_model.*`, fused `mlp.experts.gate_up_proj` / `down_proj`, zero-centred RMSNorm
weights (`mtp.*` norms too), `lm_head.weight`. transformers and stock mlx-lm skip `mtp.*`; lily_mlx keeps it
in `model.mtp`. mlx-lm and lily_mlx add the 1 to the zero-centred norm weights in bf16, transformers in
float32; that rounding moves the logits by 0.2% of their largest value (argmax unchanged on the test sentence).

Tests (`tests/test_embedded.py`): lily_mlx reproduces stock mlx-lm's greedy 64-token goldens
(`tests/embedded_goldens.json`, written by `scripts/record_goldens.py`) token for token on both layouts, with
the float tensors cast to float32 after loading in both engines. Stock mlx-lm cannot run the bf16 file on
CPU (MLX's CPU `GatherMM` is float32-only), and its own bf16 run of the 4-bit file leaves its float32 goldens
after 24-37 tokens at exact top-2 ties of the bf16 logits; so lily_mlx's bf16 compute is checked
teacher-forced on the goldens (the golden token is its argmax, or within 0.25 of it, at every step).

## Shape
- hidden {t['hidden_size']}, {t['num_hidden_layers']} layers: {', '.join(t['layer_types'])}
- gated attention: {t['num_attention_heads']} query heads, {t['num_key_value_heads']} KV heads, head_dim {t['head_dim']},
  partial RoPE {t['rope_parameters']['partial_rotary_factor']} (theta {t['rope_parameters']['rope_theta']:g})
- Gated DeltaNet: {t['linear_num_key_heads']} key heads x {t['linear_key_head_dim']}, \
{t['linear_num_value_heads']} value heads x {t['linear_value_head_dim']}, conv width {t['linear_conv_kernel_dim']}
- MoE in every layer: {t['num_experts']} experts, top-{t['num_experts_per_tok']} of a softmax router (renormalised), \
expert width {t['moe_intermediate_size']}, shared expert {t['shared_expert_intermediate_size']} with a sigmoid gate
- MTP head (`mtp_num_hidden_layers: 1`): `fc([pre_fc_norm_embedding(embed(t+1)) | pre_fc_norm_hidden(h_t)])`
  -> one full-attention MoE decoder layer -> `norm` -> the shared `lm_head`, predicting token t+2. `h_t` is
  the main model's output after its final norm (the tensor `lm_head` scores), as vLLM feeds the Qwen3-Next
  head; `lily_mlx.Model.mtp_logits(hidden, next_tokens)` computes it.
- vocab {t['vocab_size']} (byte-level BPE), untied lm_head, max_position_embeddings {t['max_position_embeddings']}

## Tokenizer and chat template
Byte-level BPE trained with `tokenizers` on the training split (Qwen2's pre-tokenizer regex, NFC), plus
Qwen's special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and the non-special `<think>`,
`</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`. eos is `<|im_end|>`
(config.json lists both `<|im_end|>` and `<|endoftext|>`). The chat template follows Qwen3.6's: the
generation prompt ends in `<think>\\n` (thinking on, the default) or in an empty `<think>\\n\\n</think>\\n\\n`
(`enable_thinking=False`); tools are declared in `<tools>` and called in Qwen3.6's XML form
(`<tool_call>\\n<function=NAME>\\n<parameter=ARG>...`). One deliberate difference: past assistant turns keep
their `<think>` block unless `preserve_thinking=False` (Qwen3.6 drops it unless `preserve_thinking=True`), so
a turn's prompt plus its reply is an exact token prefix of the next turn's prompt (tested; the one
exception is an empty reasoning block generated in thinking mode, where BPE merges the two newlines of
`<think>\\n\\n</think>` that were generated one at a time).

## Data
`../corpus/stdlib_docstrings.jsonl`: CPython {stats['python']} standard-library docstrings (PSF licence, see
`../corpus/README.md`); docstring i is held out when i % {stats['val_every']} == 0. Training text is each docstring
followed by `<|endoftext|>`, with {CHAT_FRACTION:.0%} of the named ones instead rendered through the chat template
as a question about the function answered by its docstring, {THINK_FRACTION:.0%} of those with a synthetic
one-line reasoning block. {stats['train_tokens']} training tokens, {stats['val_tokens']} held-out tokens.

## Training
`{stats['command']}` (seed {stats['seed']}): main and MTP head trained jointly, loss = main cross-entropy
+ {stats['mtp_weight']} x MTP cross-entropy (token t+2) + {stats['router_aux_loss_coef']} x router
load-balancing loss (main layers and MTP layer); AdamW (0.9, 0.95), weight decay 0.1, lr {stats['lr']:g} with
linear warm-up and cosine decay to 10%, {stats['steps']} steps of {stats['batch']} x {stats['seq']} tokens, grad clip
1.0; float32, torch {stats['torch']} on {stats['threads']} CPU thread(s), {stats['train_seconds']} s on a shared
2-core machine, {stats['date']}. The weights are then rounded to bf16.

## Results (held-out text, shipped weights)
| what | value |
| --- | --- |
| held-out mean NLL (all {stats['seq']}-token windows) | {stats['val']:.3f} nats/token (perplexity {ppl:.1f}; uniform: {t['vocab_size']}) |
| same, float32 weights before bf16 rounding | {stats['val_fp32_weights']:.3f} |
| train mean NLL (sample of windows) | {stats['train']:.3f} |
| unigram entropy of the held-out tokens | {stats['val_unigram_entropy']:.3f} (perplexity {math.exp(stats['val_unigram_entropy']):.0f}) |
| next-token top-1 accuracy | {stats['val_top1']:.1%} |
| MTP mean NLL of token t+2 | {stats['val_mtp_nll']:.3f} |
| MTP top-1 accuracy (token t+2 = the true token) | {stats['val_mtp_top1']:.1%} |
| **MTP top-1 acceptance** (MTP argmax for t+2 = the main model's argmax for t+2, true tokens through t+1) | **{stats['val_mtp_acceptance']:.1%}** |

First 1024 held-out tokens as one sequence (what `tests/test_embedded.py` recomputes):
| weights, computed by | NLL | MTP acceptance |
| --- | --- | --- |
| bf16, torch float32 (training script) | {stats['heldout_nll_first_1024']:.3f} | {stats['heldout_mtp_acceptance_first_1024']:.1%} |
| bf16 upcast to float32, lily_mlx | {stats['lily_float32_heldout_nll_first_1024']:.3f} | {stats['lily_float32_heldout_mtp_acceptance_first_1024']:.1%} |
| bf16, lily_mlx in bf16 | {stats['lily_bf16_heldout_nll_first_1024']:.3f} | {stats['lily_bf16_heldout_mtp_acceptance_first_1024']:.1%} |
| 4-bit MLX layout, lily_mlx | {stats['lily_4bit_heldout_nll_first_1024']:.3f} | {stats['lily_4bit_heldout_mtp_acceptance_first_1024']:.1%} |

Acceptance is what greedy self-speculative decoding with one MTP draft token would accept on this text.
The run sees the training text {stats['steps'] * stats['batch'] * stats['seq'] / stats['train_tokens']:.1f} times; the gap between train
and held-out loss is memorisation, which is fine for a test model.

## Sample completions (lily_mlx, greedy, up to 64 tokens, stopping at eos)
bf16 (`embedded`):
{sample_block(bf16_samples)}

4-bit (`embedded-4bit`):
{sample_block(q4_samples)}
"""
    (out / "README.md").write_text(card)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-corpus", action="store_true", help="re-extract the corpus from this Python's stdlib first")
    ap.add_argument("--package-only", action="store_true", help="skip training: redo the 4-bit copy, stats and cards")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    if args.build_corpus:
        build_corpus(CORPUS)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.package_only:
        stats = json.loads((out / "training.json").read_text())
    else:
        stats = train(args, out)
        (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(package(out, stats), indent=2))


if __name__ == "__main__":
    main()
