"""The structural budget of one decode step of the 35B-A3B layer stack (40 layers: 30 Gated DeltaNet,
10 gated attention, MoE everywhere), as the GPU runs it: the kernel launches per layer and the other
MLX primitives of the compiled step's graph.

No GPU here, so the graph is traced with the dispatcher told it runs on CUDA and every custom kernel
replaced by a stand-in of the same inputs and outputs (`mx.depends` of zero outputs on the inputs),
then counted from `mx.export_to_dot`. Widths are tiny (the count does not depend on them); the layer
pattern, quantization (4-bit, 8-bit router) and dtype are the model's.
"""

from __future__ import annotations

import collections
import contextlib
import re

import mlx.core as mx
import pytest

from bench import step_dispatch
from lily_mlx import ops
from lily_mlx.decode import CompiledDecoder
from lily_mlx.ops import attn_decode, kernels

# Per decode step: DeltaNet layer = norm+in_proj, deltanet_step, out_proj+residual, norm+router, MoE gate/up,
# MoE down+combine; attention layer = the same with attn_decode for deltanet_step, plus attn_combine when the
# cache is split (the compiled decoder's capacity is a multiple of 256: always); then final norm + lm_head.
PER_DELTANET, PER_ATTENTION = 6, 6
# Outside the kernels: the K and V cache writes of each attention layer (20; with stacked_kv one concatenation
# and one write for K and for V: 4; with kv_scatter the new rows' positions, 2 more) and the logits slice; the
# embedding lookup is counted apart (CPU's graph decomposes its dequantize).
OTHER_MAX = {False: 21, True: 5}


def _primitives(outputs, path) -> collections.Counter:
    mx.export_to_dot(str(path), *outputs)
    nodes = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]', path.read_text()))
    return collections.Counter(nodes.values())


# Kernel inputs a step passes (MLX walks and records each one; ops/packing.py): by configuration, plain / packed /
# packed with each chain launch's constants bundled.
INPUT_EDGES = {"defaults": (2150, 1426), "all-chains": (1660, 936, 436)}
WEIGHTS = {False: 0, True: 1, "bundled": 2}  # the packed parameter: plain, packed_weights, + bundled_weights


@pytest.mark.parametrize("stacked, fold, chain, dn_chain, attn, scatter, packed", [
    (False, False, False, 0, False, False, False), (True, False, False, 0, False, False, False),
    (True, True, False, 0, False, False, False), (True, True, True, 0, False, False, False),
    (True, True, True, 1, False, False, False), (True, True, True, 2, False, False, False),
    (True, True, True, 2, True, False, False), (False, False, False, 0, False, True, False),
    (True, True, False, 0, False, True, False), (True, True, False, 0, False, False, True),
    (True, True, True, 2, True, False, True), (True, True, True, 2, True, False, "bundled")],
    ids=["per-layer-kv", "stacked-kv", "stacked-kv+qmv_attn+dequant_rows", "defaults+moe_chain",
         "defaults+moe_chain+deltanet_chain", "defaults+moe_chain+deltanet_chain_out", "all-chains",
         "per-layer-kv+kv_scatter", "defaults+kv_scatter", "defaults+packed_weights", "all-chains+packed_weights",
         "all-chains+packed+bundled_weights"])
def test_decode_step_budget(monkeypatch, tmp_path, stacked, fold, chain, dn_chain, attn, scatter, packed):
    """Kernel launches and other primitives of one compiled decode step of the 40-layer shape. With qmv_attn
    (attention's split merge inside o_proj) and dequant_rows (the embedding lookup in one launch), both on by
    default, the whole step, its embedding included, is within issue 4's budget of 250; moe_chain (opt-in) runs each
    MoE block, its router included, as one launch (80 fewer), deltanet_chain each DeltaNet layer's input projection
    and step (30 fewer; dn_chain 1), deltanet_chain_out its output projection too (60 fewer; dn_chain 2), attn_chain
    each attention layer's input projection, attention and output projection (20 fewer). packed: packed_weights,
    and with "bundled" bundled_weights too (launch counts unchanged)."""
    cached = 8
    model = step_dispatch.layer_stack()
    cache = model.make_cache()
    model(mx.array([list(range(1, cached + 1))]), cache=cache)  # the real prefill, on the CPU
    bundled = packed == "bundled"
    switches = contextlib.ExitStack()
    for name, on in (("qmv_attn", fold), ("dequant_rows", fold), ("moe_chain", chain), ("deltanet_chain", dn_chain == 1),
                     ("deltanet_chain_out", dn_chain == 2), ("attn_chain", attn), ("kv_scatter", scatter),
                     ("packed_weights", bool(packed)), ("bundled_weights", bundled),
                     ("kv_write", False)):  # counts the writes; kv_write's step: the test below
        switches.enter_context(ops.switched(name, on))
    launches, standin_outputs, edges = collections.Counter(), [0], [0]

    def standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes, init_value, smem):
        base = name.removesuffix(kernels.PACKED).removesuffix(kernels.BUNDLED)
        plain = kernels.SPECS[base]
        launches[base] += 1
        want = base + (kernels.BUNDLED if bundled and plain.bundle else kernels.PACKED if packed and plain.weights else "")
        assert name == want, f"{name} launched where {want} should be"
        standin_outputs[0] += len(output_shapes)
        edges[0] += len(inputs)
        return step_dispatch.standin(name, backend, inputs, template, grid, group, output_shapes, output_dtypes,
                                     init_value, smem)

    monkeypatch.setattr(kernels, "launch", standin)  # after kernels.call's checks and its packed-weight swap
    monkeypatch.setattr(ops, "backend", lambda: "cuda")
    with switches, ops.switched("stacked_kv", stacked):
        # packs the weights (fuse_projections) when packed, bundles each chain launch's constants when bundled
        dec = CompiledDecoder(model, cache, reserve=4)
        assert dec.stacked == stacked
        mx.eval(dec.kv, dec.states)
        flat = [a for pair in dec.kv for a in pair] + [a for pair in dec.states for a in pair]
        step = dec._step(mx.array([[1]]), mx.array([dec.offset], dtype=mx.int32), *flat)
    counts = _primitives(step, tmp_path / "step.dot")
    config = {(True, True, False, 0, False, False): "defaults", (True, True, True, 2, True, False): "all-chains"}.get(
        (stacked, fold, chain, dn_chain, attn, scatter))
    if config:
        assert edges[0] == INPUT_EDGES[config][WEIGHTS[packed]], f"{config}: {edges[0]} kernel inputs a step"
    # The lookup's own primitives (MLX's gathers and dequantize; the CPU's graph decomposes the dequantize): counted
    # apart, or, with dequant_rows, one launch of the step.
    embed = (collections.Counter() if fold else
             _primitives([model.language_model.model.embed_tokens(mx.array([[1]]))], tmp_path / "embed.dot"))

    n_attn = sum(not l.is_linear for l in model.layers)
    n_dn = len(model.layers) - n_attn
    split = attn_decode.splits(1, model.config.num_key_value_heads, dec.kv[0][0].shape[2]) > 1
    assert n_dn == 30 and n_attn == 10
    expected = {"qmv": 3 * len(model.layers) + 1, "deltanet_step": n_dn, "attn_decode": n_attn,
                "moe_gate_up": len(model.layers), "moe_down_combine": len(model.layers)}
    if split and fold:  # each attention layer's o_proj merges the splits itself
        expected["qmv"] -= n_attn
        expected["qmv_attn"] = n_attn
    if fold:
        expected["dequant_rows"] = 1
    elif split:
        expected["attn_combine"] = n_attn
    if chain:  # the router's qmv, gate/up and down: one launch
        expected["qmv"] -= len(model.layers)
        del expected["moe_gate_up"], expected["moe_down_combine"]
        expected["moe_chain"] = len(model.layers)
    if dn_chain:  # a DeltaNet layer's input qmv and its step (and with _out its output qmv): one launch
        expected["qmv"] -= dn_chain * n_dn
        del expected["deltanet_step"]
        expected["deltanet_chain" if dn_chain == 1 else "deltanet_chain_out"] = n_dn
    if attn:  # an attention layer's input qmv, attn_decode and qmv_attn: one launch, merging a split cache apart
        expected["qmv"] -= n_attn
        del expected["attn_decode"], expected["qmv_attn"]
        expected["attn_chain_long" if split else "attn_chain"] = n_attn
    assert dict(launches) == expected
    per_layer = {"deltanet": PER_DELTANET - 2 * chain - dn_chain,  # dn_chain: launches it saves in a layer
                 "attention": PER_ATTENTION - 2 * chain - 2 * attn + (split and not fold)}
    assert sum(launches.values()) == n_dn * per_layer["deltanet"] + n_attn * per_layer["attention"] + 1 + fold

    other = counts - embed
    other["Broadcast"] -= standin_outputs[0]
    other["Depends"] -= sum(launches.values())
    other = +other  # drop the zeros
    # The K/V writes (decode.write_rows); with kv_scatter their positions too (a reshape and a broadcast).
    assert other["ScatterAxis" if scatter else "DynamicSliceUpdate"] == (2 if stacked else 2 * n_attn)
    assert other["Concatenate"] == (2 if stacked else 0)
    assert sum(other.values()) <= OTHER_MAX[stacked] + 2 * scatter, f"primitives outside the kernels: {dict(other)}"
    total = sum(launches.values()) + sum(other.values()) + sum(embed.values())
    print(f"cached {cached}: {sum(launches.values())} kernel launches, {sum(other.values())} other primitives "
          f"{dict(other)}, embedding lookup {sum(embed.values())} on CPU's graph; {total} in all")
    step_total = sum(launches.values()) + sum(other.values())  # with dequant_rows, the embedding included
    # 247 by default (249 with kv_scatter); 167 with moe_chain, 137 with deltanet_chain too, 107 with
    # deltanet_chain_out instead, 87 with attn_chain as well
    assert split and step_total == 272 + 2 * scatter - 16 * stacked - 9 * fold - 80 * chain - 30 * dn_chain - 20 * attn
    if fold:
        assert step_total <= 250
    if stacked and fold:
        assert ops.enabled("stacked_kv") and ops.enabled("qmv_attn") and ops.enabled("dequant_rows")  # the defaults


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_kv", "per-layer"])
def test_kv_write_step_writes_the_rows_in_its_attention_launches(monkeypatch, tmp_path, stacked):
    """kv_write with the defaults (every chain, kv_scatter; stacked_kv or per-layer caches): each attention launch is
    built with KVW and the step's cache outputs depend on them, so the step has no row concatenation and no scatter
    (stacked: 2 concatenations, 20 copies and 2 scatters a step; per layer: 2 scatters a layer), and its launches are
    the same as without it."""
    model = step_dispatch.layer_stack()
    caches = {on: model.make_cache() for on in (False, True)}
    for c in caches.values():
        model(mx.array([[1, 2, 3]]), cache=c)  # the real prefill, on the CPU
    counts, kvw = {}, {}
    for on in (False, True):
        launched = collections.Counter()

        def standin(name, backend, inputs, template, *rest):
            launched[name] += 1
            if name.startswith("attn_chain"):
                kvw.setdefault(on, set()).add(dict(template)["KVW"])
            return step_dispatch.standin(name, backend, inputs, template, *rest)

        monkeypatch.setattr(kernels, "launch", standin)
        monkeypatch.setattr(ops, "backend", lambda: "cuda")
        with ops.switched("kv_write", on), ops.switched("stacked_kv", stacked):
            dec = CompiledDecoder(model, caches[on], reserve=4)
            assert dec.stacked == stacked
            mx.eval(dec.kv, dec.states)
            flat = [a for pair in dec.kv for a in pair] + [a for pair in dec.states for a in pair]
            launched.clear()  # the step's own launches
            step = dec._step(mx.array([[1]]), mx.array([dec.offset], dtype=mx.int32), *flat)
        counts[on] = (_primitives(step, tmp_path / f"step{on}.dot"), launched)
    (off, off_launches), (with_kv, on_launches) = counts[False], counts[True]
    n_attn = sum(not l.is_linear for l in model.layers)
    assert on_launches == off_launches and kvw == {False: {False}, True: {True}}
    assert off["ScatterAxis"] == (2 if stacked else 2 * n_attn) and off["Concatenate"] == (2 if stacked else 0)
    assert with_kv["ScatterAxis"] == 0 and with_kv["Concatenate"] == 0
    assert with_kv["Depends"] == off["Depends"] + (1 if stacked else n_attn)  # the cache outputs after the launches
