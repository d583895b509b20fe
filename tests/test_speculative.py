"""MTP speculative decoding (lily_mlx.speculative) on the embedded model, whose MTP head is trained: greedy tokens,
the caller's cache afterwards and the logits processors' view are the plain decoder's; drafts are accepted and
rejected (and a run of rejections absorbed); what cannot be rolled back or drafted from is refused by name."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

import lily_mlx
from lily_mlx import decode, ops, speculative
from lily_mlx.decode import CompiledDrafter, CompiledVerifier
from lily_mlx.embedded import EMBEDDED_MODEL
from lily_mlx.generation import generate_step, stream_generate
from lily_mlx.model import DECODE_TOKENS_MAX

PROMPT = "def read_config(path):\n    \"\"\"Return the settings"


@pytest.fixture(scope="module")
def embedded():
    """The embedded model in float32 (ties between logits are then the model's, not bf16 rounding's) and its
    tokenizer."""
    model, _ = lily_mlx.load_model(EMBEDDED_MODEL, dtype=mx.float32)
    _, tok = lily_mlx.load("embedded")
    return model, tok


def _caches_equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if hasattr(x, "offset"):
            assert x.offset == y.offset, f"layer {i}: KV cache lengths {x.offset} vs {y.offset}"
            for s, t in ((x.keys, y.keys), (x.values, y.values)):  # past offset: whatever was trimmed
                assert mx.allclose(s[..., :x.offset, :], t[..., :x.offset, :], atol=1e-5).item(), f"layer {i}: K/V differ"
        else:
            for s, t in zip(x.cache, y.cache):
                assert mx.allclose(s, t, atol=1e-5).item(), f"layer {i}: DeltaNet state differs"


@pytest.mark.parametrize("resident", [False, True], ids=["host-decides", "resident"])
@pytest.mark.parametrize("penalty", [None, 1.3], ids=["greedy", "repetition-penalty"])
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 40])
def test_tokens_and_cache_are_the_plain_decoders(embedded, max_tokens, penalty, resident):
    """The same tokens as generate_step, and the caller's cache ends as generate_step leaves it (the prompt and every
    yielded token, no draft), whether generation stops after an accepted or a rejected draft; with mtp_resident too
    (logits processors keep the host's loop)."""
    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    procs = None if penalty is None else make_logits_processors(repetition_penalty=penalty, repetition_context_size=16)
    plain_cache, spec_cache = model.make_cache(), model.make_cache()
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=max_tokens, logits_processors=procs,
                                         prompt_cache=plain_cache)]
    with ops.switched("mtp_resident", resident):
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=max_tokens, logits_processors=procs,
                                                  prompt_cache=spec_cache))
    assert [t for t, _, _ in spec] == plain
    assert all(lp.shape == (model.config.vocab_size,) for _, lp, _ in spec)
    _caches_equal(plain_cache, spec_cache)
    if max_tokens == 40:  # the trained head's drafts (0.4 of held-out positions) hold for a share of the tokens
        assert sum(d for _, _, d in spec) >= (10 if penalty is None else 5)


RESIDENT = pytest.mark.parametrize("resident", [False, True], ids=["host-decides", "resident"])


@RESIDENT
def test_kv_scatter_through_the_verify(embedded, resident):
    """With kv_scatter the verify's several-row K/V writes (positions start + t, computed on the GPU in the resident
    loop) leave the tokens and the caller's cache as plain decoding without it does."""
    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    plain_cache, spec_cache = model.make_cache(), model.make_cache()
    with ops.switched("kv_scatter", False):
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=30, prompt_cache=plain_cache)]
    with ops.switched("kv_scatter", True), ops.switched("mtp_resident", resident):
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=30, prompt_cache=spec_cache))
    assert [t for t, _, _ in spec] == plain and sum(d for _, _, d in spec) > 0
    _caches_equal(plain_cache, spec_cache)


@RESIDENT
def test_one_and_two_token_prompts(embedded, resident):
    """Nothing to prefill (the first forward and draft run on empty caches), or one token: the plain tokens."""
    model, _ = embedded
    for ids in ([5], [5, 9]):
        prompt = mx.array(ids)
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=12)]
        with ops.switched("mtp_resident", resident):
            assert [t for t, _, _ in speculative.mtp_generate_step(prompt, model, max_tokens=12)] == plain


@RESIDENT
def test_unbounded_generation_closed_early(embedded, resident):
    """max_tokens=-1 past the compiled steps' first capacity (256 positions: both grow; in the resident loop by the
    host's bound on offsets the GPU computes), the generator closed by its consumer: the plain tokens, and the
    caller's cache holds exactly the prompt and the yielded tokens."""
    import itertools

    model, _ = embedded
    prompt = mx.array([5, 9, 33, 7])
    caches, runs = (model.make_cache(), model.make_cache()), []
    for steps, cache in zip((generate_step, speculative.mtp_generate_step), caches):
        with ops.switched("mtp_resident", resident):
            gen = steps(prompt, model, max_tokens=-1, prompt_cache=cache)
            runs.append([item[0] for item in itertools.islice(gen, 290)])
            gen.close()
    assert runs[0] == runs[1]
    _caches_equal(*caches)


def test_eager_forwards_without_compiled_decode(embedded):
    """With compiled_decode off the verify forwards run eagerly over mlx-lm's caches (rolled back by keeping the
    DeltaNet arrays and trimming the KV caches): the same tokens and cache as the plain decoder's."""
    from lily_mlx import ops

    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    plain_cache, spec_cache = model.make_cache(), model.make_cache()
    with ops.disabled("compiled_decode"):
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=25, prompt_cache=plain_cache)]
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=25, prompt_cache=spec_cache))
    assert [t for t, _, _ in spec] == plain and any(d for _, _, d in spec)
    _caches_equal(plain_cache, spec_cache)


def _counted(monkeypatch) -> list:
    """The token count of every verify forward queued, by the host's loop or by the GPU's decision."""
    forwards, call, selected = [], CompiledVerifier.__call__, CompiledVerifier.selected
    monkeypatch.setattr(CompiledVerifier, "__call__", lambda self, x: forwards.append(x.shape[1]) or call(self, x))
    monkeypatch.setattr(CompiledVerifier, "selected",
                        lambda self, x, *a: forwards.append(("selected", x.shape[1])) or selected(self, x, *a))
    return forwards


LOOPS = {"restart": dict(verify_keep=False, mtp_resident=False), "verify_keep": dict(verify_keep=True,
         mtp_resident=False), "resident": dict(verify_keep=False, mtp_resident=True)}


@pytest.mark.parametrize("loop", LOOPS)
def test_rejections_in_a_row_are_absorbed(embedded, monkeypatch, loop):
    """An MTP head that drafts token 0 every time: every draft is rejected, the pending tokens grow to MAX_PENDING and
    are absorbed, or with verify_keep (the states before each forward's draft kept) never grow: every forward is a
    sample and a draft. With mtp_resident each forward is decided on the GPU: one forward a token, none undone. The
    tokens and the cache are still the plain decoder's."""
    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    plain_cache, spec_cache = model.make_cache(), model.make_cache()
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=13, prompt_cache=plain_cache)]
    real, drafted, picked = model.mtp_hidden, CompiledDrafter.__call__, CompiledDrafter.picked
    monkeypatch.setattr(model, "mtp_hidden", lambda h, t, c=None: mx.zeros_like(real(h, t, c)))  # logits all 0
    monkeypatch.setattr(CompiledDrafter, "__call__", lambda self, h, t: mx.zeros_like(drafted(self, h, t)))
    monkeypatch.setattr(CompiledDrafter, "picked", lambda self, *a: mx.zeros_like(picked(self, *a)))
    forwards = _counted(monkeypatch)
    with ops.switched([n for n, on in LOOPS[loop].items() if on], True), \
            ops.switched([n for n, on in LOOPS[loop].items() if not on], False):
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=13, prompt_cache=spec_cache))
    assert [t for t, _, _ in spec] == plain and not any(d for _, _, d in spec)
    if loop == "resident":  # the first token is the prompt's, then 12 forwards of one token each (none queued past
        assert forwards == [("selected", 2)] * 12 + [1]  # max_tokens), and the last token into the caller's cache
    else:
        assert max(forwards) == (2 if loop == "verify_keep" else speculative.MAX_PENDING + 1)  # pending, and a draft
    _caches_equal(plain_cache, spec_cache)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("max_tokens", [7, 8, 9, 30])
def test_forward_queued_ahead_is_undone_on_rejection(embedded, monkeypatch, max_tokens, loop):
    """Drafts right at two positions of three, wrong at the third (so the forward queued ahead on the assumption of an
    accepted draft is undone every few forwards, the head's cache with it), generation stopping at either kind of
    decision: the plain tokens and cache, and the confirmed drafts where the pattern puts them; with verify_keep a
    rejection rolls back to the states before the draft, and every forward is a sample and a draft; with mtp_resident
    no forward is undone (the GPU picks each one's start), so there is one forward a decision."""
    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    plain_cache, spec_cache = model.make_cache(), model.make_cache()
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=max_tokens + 2, prompt_cache=plain_cache)]
    n, drafted, picked = prompt.size, CompiledDrafter.__call__, CompiledDrafter.picked

    def drafting(out, p):  # the head at position p drafts token p + 2
        i = p + 2 - n
        want = plain[i] if 0 <= i < len(plain) else 0
        return out * 0 + (want if i % 3 else want + 1)

    # the host's loop: the head's offset is now the last p + 1; the GPU's: it drafts after position offset1 + pick1
    monkeypatch.setattr(CompiledDrafter, "__call__", lambda self, h, t: drafting(drafted(self, h, t), self.offset - 1))
    monkeypatch.setattr(CompiledDrafter, "picked", lambda self, h, t, offset1, pick1, length: drafting(
        picked(self, h, t, offset1, pick1, length), offset1.item() + pick1.item()))
    forwards = _counted(monkeypatch)
    with ops.switched([n for n, on in LOOPS[loop].items() if on], True), \
            ops.switched([n for n, on in LOOPS[loop].items() if not on], False):
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=spec_cache))
    assert [t for t, _, _ in spec] == plain[:max_tokens]
    confirmed, i, decisions = [], 1, 0  # token 0 is sampled; a confirmed draft at i brings a sample at i + 1
    while i < max_tokens:
        confirmed += [i] if i % 3 else []
        i += 2 if i % 3 else 1
        decisions += 1
    assert [i for i, (_, _, d) in enumerate(spec) if d] == confirmed
    if loop == "resident":  # one forward a decision, none undone; one past them where the last brought 2 tokens
        selected = [f for f in forwards if isinstance(f, tuple)]  # (the host cannot know it would), then what the
        assert set(selected) == {("selected", 2)} and forwards[:len(selected)] == selected  # caller's cache lacks
        assert decisions <= len(selected) <= decisions + 1
    else:
        assert max(forwards) == (2 if loop == "verify_keep" else 3)  # without it a rejected forward's sample goes again
    plain_cache = model.make_cache()
    list(generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=plain_cache))
    _caches_equal(plain_cache, spec_cache)


def test_sampled_resident_tokens_follow_the_seed(embedded):
    """Sampled MTP decoding with the GPU deciding: the same seed gives the same tokens and log-probabilities, and the
    caller's cache holds the prompt and those tokens, as a forward over them leaves it."""
    from mlx_lm.sample_utils import make_sampler

    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    runs, caches = [], []
    for _ in range(2):
        mx.random.seed(7)
        caches.append(model.make_cache())
        with ops.switched("mtp_resident", True):
            runs.append(list(speculative.mtp_generate_step(prompt, model, max_tokens=24, sampler=make_sampler(0.7),
                                                           prompt_cache=caches[-1])))
    assert [t for t, _, _ in runs[0]] == [t for t, _, _ in runs[1]]
    assert all(mx.allclose(a, b).item() for (_, a, _), (_, b, _) in zip(*runs))
    _caches_equal(*caches)
    tokens = [t for t, _, _ in runs[0]]
    plain_cache = model.make_cache()  # the prompt and every yielded token, no draft
    model(mx.concatenate([prompt, mx.array(tokens)])[None], cache=plain_cache)
    _caches_equal(plain_cache, caches[0])


def test_stream_generate_and_cli_with_mtp(embedded):
    """stream_generate(mtp=True): the plain text, from_draft on the confirmed drafts; `lily-mlx generate --mtp`."""
    from lily_mlx.generate import main

    _, tok = embedded
    model, _ = lily_mlx.load("embedded")
    plain = "".join(r.text for r in stream_generate(model, tok, PROMPT, max_tokens=30))
    responses = list(stream_generate(model, tok, PROMPT, max_tokens=30, mtp=True))
    assert "".join(r.text for r in responses) == plain
    assert any(r.from_draft for r in responses) and responses[-1].finish_reason == "length"
    assert main(["--mtp", "--prompt", PROMPT, "-m", "6", "--ignore-chat-template", "--verbose", "false"]) == 0


def test_what_mtp_cannot_do_is_refused(embedded, tiny_checkpoints, capsys):
    from lily_mlx.generate import main

    model, tok = embedded
    prompt = mx.array(tok.encode(PROMPT))
    no_head, _ = lily_mlx.load(str(tiny_checkpoints[0]["mlx"]))
    for kw, message in [(dict(max_kv_size=64), "max_kv_size"), (dict(kv_bits=4), "kv_bits"),
                        (dict(input_embeddings=mx.zeros((prompt.size, 64))), "input_embeddings")]:
        with pytest.raises(ValueError, match=message):
            list(generate_step(prompt, model, mtp=True, **kw))
    with pytest.raises(ValueError, match="no MTP head"):
        list(generate_step(prompt, no_head, mtp=True))
    with pytest.raises(ValueError, match="RotatingKVCache"):
        list(generate_step(prompt, model, mtp=True, prompt_cache=model.make_cache(max_kv_size=64)))
    with pytest.raises(ValueError, match="1-D prompt"):
        list(generate_step(prompt[None], model, mtp=True))
    assert main(["--model", str(tiny_checkpoints[0]["mlx"]), "--mtp", "-p", "hi", "-m", "3"]) == 2
    assert "no MTP head" in capsys.readouterr().err


def test_several_tokens_take_the_decode_path(embedded, monkeypatch):
    """2 to 8 tokens after a cache go through the decode step one at a time (model.DECODE_TOKENS_MAX): the logits
    and the caches are the prefill path's."""
    from lily_mlx import model as model_mod

    model, tok = embedded
    prompt = mx.array([tok.encode(PROMPT)])
    runs = []
    for most in (model_mod.DECODE_TOKENS_MAX, 1):  # 1: every several-token forward takes the prefill path
        monkeypatch.setattr(model_mod, "DECODE_TOKENS_MAX", most)
        cache = model.make_cache()
        model(prompt, cache=cache)
        logits = [model(mx.array([list(range(7, 7 + n))]), cache=cache) for n in (2, 5, 8)]
        runs.append((logits, cache))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
    _caches_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("chains", ["off", "defaults", "opted-in"])
def test_verify_step_launches(monkeypatch, tmp_path, chains):
    """The compiled verify step at the 35B-A3B layer stack (tests/test_decode_budget.py's stand-ins): its T tokens
    take a decode step's launches, each kernel once for all of them (with every chain opted into: two a layer; by
    default the chains take one or two tokens), and its other primitives."""
    import collections
    import contextlib

    from lily_mlx import ops
    from lily_mlx.ops import kernels
    from bench.step_dispatch import layer_stack
    from test_decode_budget import _primitives

    model = layer_stack()
    cache = model.make_cache()
    model(mx.array([list(range(1, 9))]), cache=cache)
    launches, alt_launches = collections.Counter(), collections.Counter()

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value=None):
        launches[name.removesuffix("_alt")] += 1
        alt_launches[name] += name.endswith("_alt")
        outs = [mx.broadcast_to(mx.array(0, dtype=d), s) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))

    monkeypatch.setattr(kernels, "call", standin)
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    # the cache is split (reserve 8 past the prompt): the chain merges it in a phase of its own
    chained = {"dequant_rows": 1, "deltanet_chain_out": 30, "attn_chain_long": 10, "moe_chain": 40}
    unchained = {"dequant_rows": 1, "qmv": 110, "deltanet_step": 30, "attn_decode": 10, "qmv_attn": 10,
                 "moe_gate_up": 40, "moe_down_combine": 40}
    names = ("moe_chain", "deltanet_chain_out", "attn_chain")
    totals = {}
    for T in (1, 2, 3, 5):
        with contextlib.ExitStack() as switches:
            switches.enter_context(ops.switched("prefill_overlap", False))  # an eager call here; traces never dispatch
            for name in names if chains != "defaults" else ():
                ops.set_enabled(name, chains == "opted-in")
            verifier = CompiledVerifier(model, cache, reserve=8)
            flat = [a for pair in verifier.kv for a in pair] + [a for pair in verifier.states for a in pair]
            mx.eval(flat)
            launches.clear()
            alt_launches.clear()
            tokens, offset1 = mx.array([list(range(1, T + 1))]), mx.array([verifier.offset], dtype=mx.int32)
            out = verifier._step(tokens, offset1, *flat)
            if T == 2:  # the resident loop's forward (mtp_resident): the last forward's states picked on the GPU
                step = decode._step_function(verifier._kind("verify_select"))
                states = [a for pair in verifier.states for a in pair]
                selected = step(model, len(cache), verifier.kv_index, verifier.state_index, tokens, offset1,
                                mx.array([True]), *flat, *states)
        expected = chained if chains == "opted-in" or (chains == "defaults" and T <= 2) else unchained
        # the resident forward's DeltaNet launches are their _alt variants (the picked states read in place)
        assert sum(alt_launches.values()) == (30 if T == 2 else 0), alt_launches
        assert dict(launches) == ({n: 2 * c for n, c in expected.items()} if T == 2 else expected)
        counts = _primitives(out, tmp_path / f"verify{T}.dot")
        # An integer index on a kept state is a gather, a copy of it (H100 run 85: 1.85 ms of a 4.2 ms verify).
        assert counts["Gather"] == 0
        totals[T] = sum(counts.values()) - counts["Broadcast"]  # the stand-ins' broadcasts are not the step's
        print(f"verify step, {T} tokens, chains {chains}: {totals[T]} primitives")
        if T == 2:  # the DeltaNet kernels pick the states in place (ALT): not one select or copy more
            picked = _primitives(selected, tmp_path / "selected.dot")
            assert picked["Gather"] == 0 and picked["Select"] == counts["Select"]
            assert sum(picked.values()) - picked["Broadcast"] == totals[2] + \
                (0 if ops.enabled("verify_keep") else 2 * 3 * 30)  # its kept states: verify_keep's views
    # By default the chains take one or two tokens, and on CUDA verify_keep's kept states cost 3 views a DeltaNet
    # state (a split and two squeezes) from 2 tokens on: compare like with like.
    first = 3 if chains == "defaults" else 2
    assert totals[5] <= totals[first] + 2  # the slice of the last two positions
    assert totals[2] <= totals[1] + 2 + 2 * 3 * 30


def _on_the_gpu(chains: str) -> None:
    """MTP decoding on the GPU's kernels (the verify's tokens through deltanet_step / attn_decode, or every chain
    opted in; by default on CUDA the one-token steps and 2-token verifies chained, longer verifies not; verify_keep:
    the defaults keeping the states before each draft; resident: the defaults deciding each draft on the GPU) against
    plain decoding, the embedded 4-bit model in float32:
    the same 40 greedy tokens, drafts accepted."""
    from lily_mlx import ops
    from lily_mlx.embedded import EMBEDDED_4BIT_MODEL

    model, _ = lily_mlx.load_model(EMBEDDED_4BIT_MODEL, dtype=mx.float32)
    _, tok = lily_mlx.load("embedded")
    # At most DECODE_TOKENS_MAX prompt tokens, so that the prefill's MoE blocks take moe_chain too (it declines more).
    prompt = mx.array(tok.encode(PROMPT))[:DECODE_TOKENS_MAX]
    names = ("moe_chain", "deltanet_chain_out", "attn_chain")
    with ops.disabled():  # restores every switch afterwards
        for name in names if chains in ("off", "opted-in") else ():
            ops.set_enabled(name, chains == "opted-in")
        ops.set_enabled("verify_keep", chains == "verify_keep")
        ops.set_enabled("mtp_resident", chains == "resident")
        watched = names if chains == "opted-in" else ()  # by default the chains decline 3+ tokens
        before = {n: ops.declined.get(n, 0) for n in ("deltanet_step", "attn_decode", "qmv_attn", *watched)}
        plain = [t for t, _ in generate_step(prompt, model, max_tokens=40)]
        spec = list(speculative.mtp_generate_step(prompt, model, max_tokens=40))
        assert {n: ops.declined.get(n, 0) for n in before} == before, "a kernel declined the verify's tokens"
    assert [t for t, _, _ in spec] == plain and sum(d for _, _, d in spec) >= 8


@pytest.mark.cuda
@pytest.mark.parametrize("chains", ["off", "defaults", "opted-in", "verify_keep", "resident"])
def test_mtp_matches_plain_decoding_cuda(chains):
    _on_the_gpu(chains)


@pytest.mark.metal
@pytest.mark.parametrize("chains", ["off", "defaults", "opted-in", "verify_keep", "resident"])
def test_mtp_matches_plain_decoding_metal(chains):
    _on_the_gpu(chains)
