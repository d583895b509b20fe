"""Custom-kernel infrastructure: kernel sources, per-backend assembly, compiled-kernel cache, registry.

Each kernel is ONE body, kernels/<name>.inc, shared by CUDA and Metal. A backend's face is a
header (kernels/prelude_<backend>.h: macros and inline functions for barriers, shuffles, loads,
conversions) and an entry snippet (kernels/entry_<backend>.inc: the launch indices, declared at the
top of the body). kernels/prelude_common.h follows the backend header: helpers written only in its
names (the 4-bit/8-bit chunk dot product, swizzles). The wheel carries kernels/ as lily_mlx/kernels
(pyproject's force-include); a source checkout reads the repository's kernels/ directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from . import metal_source, packing

TemplateArg = Union[int, bool, mx.Dtype]
BACKENDS = ("cuda", "metal")

_PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kernels"  # installed wheel
_REPO_DIR = Path(__file__).resolve().parents[2] / "kernels"  # source checkout


def kernel_dir() -> Path:
    for d in (_PACKAGE_DIR, _REPO_DIR):
        if (d / "prelude_cuda.h").is_file():
            return d
    raise FileNotFoundError(f"kernel sources not found: looked for prelude_cuda.h in {_PACKAGE_DIR} and {_REPO_DIR}")


def compact(src: str) -> str:
    """Drops // comments, indentation and blank lines: MLX hashes a custom kernel's full source on every
    launch (mlx/backend/cuda/custom_kernel.cpp), and decode is bound by that per-launch CPU cost."""
    out = []
    for line in src.splitlines():
        cut = line.find("//")
        if cut >= 0 and line.count('"', 0, cut) % 2 == 0:
            line = line[:cut]
        line = line.strip()
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


@functools.lru_cache(maxsize=None)
def read_source(filename: str) -> str:
    """A kernel source file, compacted: the text MLX compiles (and the compile checks see)."""
    path = kernel_dir() / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} does not exist")
    return compact(path.read_text())


def row_bucket(rows: int) -> int:
    """The power of two >= rows that a decode kernel is built for: it reads its row count at run time, so
    batches of 3 and 4 rows share one JIT build (each build is a multi-second NVRTC compile on a fresh machine)."""
    return 1 << max(0, rows - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count() -> Optional[int]:
    """The CUDA device's multiprocessors, from the driver (MLX's device_info does not carry them); None without one.
    A chained kernel's plan sizes a phase to one wave of its blocks with it."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, count = ctypes.c_int(), ctypes.c_int()
    multiprocessor_count = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0) or \
            cuda.cuDeviceGetAttribute(ctypes.byref(count), multiprocessor_count, device):
        return None
    return count.value


@dataclass(frozen=True)
class Instance:
    """One concrete call of a kernel: what MLX needs to write its full source."""

    template: tuple[tuple[str, TemplateArg], ...]
    inputs: tuple[tuple[mx.Dtype, tuple[int, ...]], ...]  # (dtype, shape) per input
    output_dtypes: tuple[mx.Dtype, ...]


SM_REGISTERS = 64 * 1024  # a CUDA SM's 32-bit registers (sm_70 to sm_90)


@dataclass(frozen=True)
class KernelSpec:
    name: str  # MLX kernel name; the body is kernels/<body>
    body: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    template_params: tuple[str, ...]  # names, in the order calls pass them
    description: str
    instances: Callable[[], list[Instance]]  # the instantiations the project uses (compile checks)
    defines: tuple[str, ...] = ()  # LILY_* names whose #ifdef blocks of the body this kernel keeps
    # CUDA __launch_bounds__(threads, min blocks an SM): MLX writes the __global__ line itself, so the header
    # redefines __global__ to carry them (ptxas then caps the registers for that many resident blocks).
    cuda_launch_bounds: tuple[int, ...] = ()
    # CUDA __maxnreg__: a lane's registers capped whatever the block size (the blocks an SM holds then follow); or a
    # function of an instance's template arguments (a dict) giving its cap, 0 for none. Beside a launch bound of
    # threads alone, the cap becomes its min blocks an SM (NVRTC rejects both attributes on one kernel).
    cuda_max_registers: Union[int, Callable[[dict], int]] = 0
    # (codes, scales, biases) input names of quantized weights that may arrive packed as one array (ops/packing.py):
    # register_spec then registers this spec's packed variant too, <name>_pw, each triple one input <codes>_pw.
    weights: tuple[tuple[str, str, str], ...] = ()
    packed_from: str = ""  # a packed variant: the spec it was made from
    # Constant inputs (a weight by its codes' name) that may arrive as one bundle (packing.bundle): register_spec
    # then registers <name>_pb too, which takes them as one input, `bundle`, at offsets its template gives.
    bundle: tuple[str, ...] = ()
    bundled_from: str = ""  # a bundled variant: the spec it was made from


SPECS: dict[str, KernelSpec] = {}


class Shaped(NamedTuple):
    """An array known only by its shape and dtype (a fused kernel's operand that is never built, such as the merged
    attention qmv_attn stages on chip): what the kernels' applicability checks read."""

    shape: tuple
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def source_key(inst: Instance):
    """What an instance's source depends on besides shapes: its template and input dtypes."""
    return inst.template, tuple(d for d, _ in inst.inputs)


def unique_instances(insts, key: Callable[[Instance], object] = lambda i: (i.template, i.inputs)) -> list[Instance]:
    """The first instance of each key, in order (compile checks need each distinct source once)."""
    seen, out = set(), []
    for inst in insts:
        k = key(inst)
        if k not in seen:
            seen.add(k)
            out.append(inst)
    return out


def float_bits(v: float) -> int:
    """The float32 bit pattern of v: how a float (an eps) reaches a kernel as an integer template argument."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


@functools.lru_cache(maxsize=None)
def placeholder(dtype: mx.Dtype) -> mx.array:
    """A one-element array for a kernel input that this instantiation never reads (evaluated: a leaf, not
    a primitive of every graph it enters)."""
    a = mx.zeros((1,), dtype=dtype)
    mx.eval(a)
    return a


SYNC_SLOTS = 16  # over metal_source.MAX_CONSTANT_ARRAY_SIZE: Metal would put fewer in its read-only constant space
TRACE_FIELDS = 6  # a traced block's SM | phase << 16, start, then its ticket, resume, mark, end (ns; sync_cuda.h)


COUNTER_POOL = 256  # counters made at once by sync_counters (64 bytes each without the trace's records)
_counter_pool: dict[int, list] = {}


def int32_scalar(value: int) -> mx.array:
    """[1] int32 holding `value`, which kernels read (a cache offset, a plane index). With switch device_scalars, a view
    into 16 bytes a GPU op fills, unevaluated (a decode step's offset is filled in that step's own graph, so the host
    does not wait for the GPU; a constant is the caller's to evaluate): MLX's CUDA allocator puts every array of up to
    8 bytes in one pool of managed memory (advised AccessedBy the GPU) and arrays made from host data in managed
    memory too; the host writes such a page every decode step, so the kernels may read their scalars from host
    memory."""
    from . import enabled

    if not enabled("device_scalars"):
        return mx.array([value], dtype=mx.int32)
    return mx.full((4,), value, dtype=mx.int32)[:1]


def sync_counters() -> mx.array:
    """Fresh int32 zeros for one launch of a kernel that orders its phases through counters (lily_sync_*). Never
    shared between launches: MLX's CUDA graphs order a kernel only after the last writer of its inputs, so two
    launches that merely read the same counters can run at once and mix their tickets (two decodes of one model in
    one eval did, H100 run 40). Evaluated here, so inside an mx.compile trace it is a constant of that launch site,
    which every replay reuses, hence every launch leaves its counters zero again. Rows of one zeros array made by a
    GPU op (switch device_counters): MLX's CUDA allocator puts arrays made from host data in managed memory, whose
    pages the host's reads move (bench/chain_trace.py's readback stalled the first tickets 6-17 us). Under the
    experiment define LILY_CHAIN_TRACE=n the blocks' trace records follow the counters (bench/chain_trace.py)."""
    from . import enabled

    n = SYNC_SLOTS + TRACE_FIELDS * chain_trace_blocks()
    if not enabled("device_counters"):
        return mx.array(np.zeros(n, dtype=np.int32))
    pool = _counter_pool.setdefault(n, [])
    if not pool:
        zeros = mx.zeros((COUNTER_POOL, n), dtype=mx.int32)
        pool.extend(zeros[i:i + 1].reshape(n) for i in range(COUNTER_POOL))  # views: zeros[i] would be a gather each
        mx.eval(pool)
    return pool.pop()


@functools.lru_cache(maxsize=None)
def records_trace(name: str) -> bool:
    """Whether spec `name`'s body records its blocks under LILY_CHAIN_TRACE (sync_cuda.h's LILY_TRACE_END)."""
    return "LILY_TRACE_END" in read_source(SPECS[name].body)


def chain_trace_blocks() -> int:
    """How many blocks a chained launch records (experiment define LILY_CHAIN_TRACE; 0: none)."""
    value = experiment_values().get("LILY_CHAIN_TRACE", "0")
    if not value.isdigit():
        raise ValueError(f"{DEFINES_ENV}: LILY_CHAIN_TRACE={value!r} is not a whole number of blocks")
    return int(value)


def register_spec(spec: KernelSpec) -> KernelSpec:
    if spec.name in SPECS and SPECS[spec.name] != spec:
        raise ValueError(f"kernel {spec.name!r} is registered twice with different specs")
    SPECS[spec.name] = spec
    if spec.weights and not (spec.packed_from or spec.bundled_from):
        register_spec(packed_spec(spec))
    if spec.bundle and not spec.bundled_from:
        register_spec(bundled_spec(spec))
    return spec


PACKED = "_pw"  # a packed variant's suffix, of its name and of each packed input's


def _folded(spec: KernelSpec) -> set[str]:
    """The inputs a packed variant does not take: each weight's scales and biases (its codes' input carries them)."""
    return {n for _, s, b in spec.weights for n in (s, b)}


def _layout_template(codes: str, scale_dtype: mx.Dtype, wrow: int, srow: int) -> list[tuple[str, TemplateArg]]:
    """A packed weight's template arguments: the type of its scales, the words of codes and the scales a row."""
    return [(f"{codes}{PACKED}_st", scale_dtype), (f"{codes}{PACKED}_wrow", wrow), (f"{codes}{PACKED}_srow", srow)]


def packed_spec(spec: KernelSpec) -> KernelSpec:
    """spec with each of its quantized weights taken as one packed input: the same body, after a preamble that
    points the weight's codes, scales and biases into it (packed_preamble)."""
    for triple in spec.weights:
        missing = [n for n in triple if n not in spec.input_names]
        if missing:
            raise ValueError(f"kernel {spec.name!r}: packed weight {triple} names inputs it does not have: {missing}")
    codes = {w for w, _, _ in spec.weights}
    names = tuple(n + PACKED if n in codes else n for n in spec.input_names if n not in _folded(spec))
    params = spec.template_params + tuple(n for w, _, _ in spec.weights for n, _ in _layout_template(w, mx.uint32, 0, 0))
    return dataclasses.replace(spec, name=spec.name + PACKED, input_names=names, template_params=params,
                               description=spec.description + "; its quantized weights packed",
                               instances=functools.partial(_packed_instances, spec), packed_from=spec.name, bundle=())


def _packed_instances(spec: KernelSpec) -> list[Instance]:
    """The packed variant's instances for the compile checks: one per type of scales (its preamble depends on nothing
    else; the body's every other instance is compiled as the unpacked spec's)."""
    insts = [i for i in map(functools.partial(packed_instance, spec), spec.instances()) if i is not None]
    return unique_instances(insts, key=lambda i: dict(i.template)[spec.weights[0][0] + PACKED + "_st"])


def packed_instance(spec: KernelSpec, inst: Instance) -> Optional[Instance]:
    """The instance of spec's packed variant for an instance of spec (None where a weight cannot be packed)."""
    shaped = dict(zip(spec.input_names, inst.inputs))
    packed, extra = {}, []
    for w, s, b in spec.weights:
        (wd, wsh), (sd, ssh) = shaped[w], shaped[s]
        if packing.why_not(Shaped(wsh, wd), Shaped(ssh, sd), Shaped(shaped[b][1], shaped[b][0])) is not None:
            return None
        packed[w] = (mx.uint32, (*wsh[:-1], packing.packed_width(Shaped(wsh, wd), Shaped(ssh, sd))))
        extra += _layout_template(w, sd, wsh[-1], ssh[-1])
    inputs = tuple(packed.get(n, shaped[n]) for n in spec.input_names if n not in _folded(spec))
    return Instance(inst.template + tuple(extra), inputs, inst.output_dtypes)


def packed_args(spec: KernelSpec, inputs: Sequence[mx.array], template: Sequence[tuple[str, TemplateArg]]):
    """(variant name, inputs, template) of the packed variant for a launch of spec whose every weight triple is
    a packed array's views (packing.lookup), else None."""
    at = {n: i for i, n in enumerate(spec.input_names)}
    swap, extra = {}, []
    for w, s, b in spec.weights:
        aw, as_ = inputs[at[w]], inputs[at[s]]
        p = packing.lookup(aw, as_, inputs[at[b]])
        if p is None:
            return None
        swap[at[w]] = p
        extra += _layout_template(w, as_.dtype, aw.shape[-1], as_.shape[-1])
    folded = _folded(spec)
    return (spec.name + PACKED, [swap.get(i, a) for i, a in enumerate(inputs) if spec.input_names[i] not in folded],
            [*template, *extra])


@functools.lru_cache(maxsize=None)
def _weight_ndims(name: str) -> dict[str, int]:
    """Each weight's rank in spec `name` (the same in every instance; its packed array's too)."""
    spec = SPECS[name]
    inst = dict(zip(spec.input_names, spec.instances()[0].inputs))
    return {w: len(inst[w][1]) for w, _, _ in spec.weights}


def packed_preamble(spec: KernelSpec, body_text: str) -> str:
    """A packed variant's first lines: each weight's codes, scales and biases as pointers into its packed input (the
    layout of ops/packing.py), with the shapes and ndim the body reads of them. Ranks are written in, so shapes are
    constant-indexed arrays (registers) and rows a product of the packed input's leading dims."""
    lines = []
    for w, s, b in spec.weights:
        p, nd = w + PACKED, _weight_ndims(spec.packed_from)[w]
        lead = [f"int({p}_shape[{d}])" for d in range(nd - 1)]
        lines += _weight_lines(spec, (w, s, b), lead, body_text)
    return "\n".join(lines) + "\n"


def _weight_lines(spec: KernelSpec, triple: tuple[str, str, str], lead: list[str], body_text: str) -> list[str]:
    """The preamble lines pointing a weight's codes, scales and biases into its packed block `<codes>_pw` (its
    leading dims the expressions `lead`), and the shapes and ndim the body reads of them."""
    w, s, b = triple
    p, nd = w + PACKED, len(lead) + 1
    lines = [f"const size_t {p}_rows = size_t({') * size_t('.join(lead)});",
             f"LILY_PACKED_WEIGHT({p}, {p}_rows, {p}_wrow, {p}_srow, {p}_st, {w}, {s}, {b});"]
    for n, last in ((w, "wrow"), (s, "srow"), (b, "srow")):
        if re.search(rf"\b{n}_strides\b", body_text):
            raise ValueError(f"kernel {spec.name!r} reads {n}_strides: a packed weight has none to give")
        if re.search(rf"\b{n}_shape\b", body_text):
            lines.append(f"const int {n}_shape[{nd}] = {{{', '.join(lead + [f'{p}_{last}'])}}};")
        if re.search(rf"\b{n}_ndim\b", body_text):
            lines.append(f"const int {n}_ndim = {nd};")
    return lines


BUNDLED = "_pb"  # a bundled variant's suffix


def weight_triples(spec: KernelSpec) -> dict[str, tuple[str, str, str]]:
    """spec's quantized weights by their codes' input name: (codes, scales, biases) names."""
    return {w: (w, s, b) for w, s, b in spec.weights}


def bundled_spec(spec: KernelSpec) -> KernelSpec:
    """spec with its constant inputs (spec.bundle) taken as one input, `bundle`: the same body, after a preamble that
    points each of them into it (bundled_preamble). Its template adds each member's offset (<name>_at) and, for a
    weight, its packed layout and rows; for an array, its type (<name>_t)."""
    triples = weight_triples(spec)
    missing = [n for n in spec.bundle if n not in spec.input_names]
    if missing or "bundle" in spec.input_names:
        raise ValueError(f"kernel {spec.name!r}: bundle {spec.bundle} names inputs it does not have: {missing}")
    gone = {n for m in spec.bundle for n in triples.get(m, (m,))}
    first = min(spec.input_names.index(n) for n in gone)
    names = tuple("bundle" if i == first else n for i, n in enumerate(spec.input_names) if n not in gone or i == first)
    shapeless = (Shaped((0, 0), mx.uint32),) * 3  # a member's template names do not depend on its shape
    params = spec.template_params + tuple(n for m in spec.bundle for n, _ in _member_template(
        m, 0, shapeless if m in triples else shapeless[0]))
    return dataclasses.replace(spec, name=spec.name + BUNDLED, input_names=names, template_params=params,
                               description=spec.description + "; its constant inputs bundled as one array",
                               instances=functools.partial(_bundled_instances, spec), weights=(), bundle=(),
                               bundled_from=spec.name)


def _member_template(m: str, at: int, member) -> list[tuple[str, TemplateArg]]:
    """A bundle member's template arguments: its word offset, then a weight's packed layout and rows (member its
    codes, scales and biases) or an array's type."""
    if packing.is_weight(member):
        w, s, _ = member
        return [(f"{m}_at", at), *_layout_template(m, s.dtype, w.shape[-1], s.shape[-1]),
                (f"{m}_bundle_rows", math.prod(w.shape[:-1]))]
    return [(f"{m}_at", at), (f"{m}_t", member.dtype)]


def bundle_members(spec: KernelSpec, named: dict) -> list:
    """spec's bundle members from its inputs by name: an input, or a weight's (codes, scales, biases)."""
    triples = weight_triples(spec)
    return [tuple(named[n] for n in triples[m]) if m in triples else named[m] for m in spec.bundle]


def _bundled_template(spec: KernelSpec, members: list, starts: list[int]) -> list[tuple[str, TemplateArg]]:
    return [a for m, member, at in zip(spec.bundle, members, starts) for a in _member_template(m, at, member)]


def _bundled_instances(spec: KernelSpec) -> list[Instance]:
    """The bundled variant's instances for the compile checks: one per member types (its preamble depends on nothing
    else; the body's every other instance is compiled as the plain spec's)."""
    insts = [bundled_instance(spec, i) for i in spec.instances()]
    return unique_instances([i for i in insts if i is not None],
                            key=lambda i: tuple(v for n, v in i.template if n.endswith(("_t", "_st"))))


def bundled_instance(spec: KernelSpec, inst: Instance) -> Optional[Instance]:
    """The instance of spec's bundled variant for an instance of spec (None where its members cannot bundle)."""
    named = {n: Shaped(sh, d) for n, (d, sh) in zip(spec.input_names, inst.inputs)}
    members = bundle_members(spec, named)
    try:
        starts, total = packing.layout(members)
    except ValueError:
        return None
    variant = SPECS[spec.name + BUNDLED]
    shaped = {**dict(zip(spec.input_names, inst.inputs)), "bundle": (mx.uint32, (total,))}
    return Instance(inst.template + tuple(_bundled_template(spec, members, starts)),
                    tuple(shaped[n] for n in variant.input_names), inst.output_dtypes)


def bundled_args(spec: KernelSpec, inputs: Sequence[mx.array], template: Sequence[tuple[str, TemplateArg]]):
    """(variant name, inputs, template) of the bundled variant for a launch of spec whose every bundle member is in
    one bundle (packing.bundled; a weight through its packed array, packing.lookup), else None."""
    named = dict(zip(spec.input_names, inputs))
    members = bundle_members(spec, named)
    blob, starts = None, []
    for member in members:
        head = packing.lookup(*member) if packing.is_weight(member) else member
        found = None if head is None else packing.bundled(head)
        if found is None or (blob is not None and found[0] is not blob):
            return None
        blob = found[0]
        starts.append(found[1])
    named["bundle"] = blob
    return (spec.name + BUNDLED, [named[n] for n in SPECS[spec.name + BUNDLED].input_names],
            [*template, *_bundled_template(spec, members, starts)])


def bundled_preamble(spec: KernelSpec, body_text: str) -> str:
    """A bundled variant's first lines: each member as a pointer into `bundle` at its offset; a weight's codes,
    scales and biases as packed_preamble points them (its rows from the template)."""
    triples, lines = weight_triples(spec), []
    for m in spec.bundle:
        if m in triples:
            if re.search(rf"\b({'|'.join(triples[m])})_shape\b", body_text) and _weight_ndims(spec.name)[m] != 2:
                raise ValueError(f"kernel {spec.name!r} reads the shape of bundled weight {m!r} of rank > 2")
            lines.append(f"const LILY_GLOBAL uint32_t* {m}{PACKED} = bundle + {m}_at;")
            lines += _weight_lines(spec, triples[m], [f"{m}_bundle_rows"], body_text)
        else:
            if re.search(rf"\b{m}_(shape|strides|ndim)\b", body_text):
                raise ValueError(f"kernel {spec.name!r} reads the shape of {m!r}: a bundled array has none to give")
            lines.append(f"const LILY_GLOBAL {m}_t* {m} = reinterpret_cast<const LILY_GLOBAL {m}_t*>(bundle + {m}_at);")
    return "\n".join(lines) + "\n"


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} has no custom kernels; expected one of {BACKENDS}")


_DEFINES = re.compile(r"LILY_INLINE[^(;{]*?\b(lily_\w+)\(|^#define (LILY_\w+)|^struct (lily_\w+)", re.M)


@functools.lru_cache(maxsize=None)
def _common_helpers() -> tuple[tuple[tuple[str, ...], str], ...]:
    """prelude_common.h as (names defined, compacted text) blocks, split at blank lines, in file order."""
    path = kernel_dir() / "prelude_common.h"
    blocks = []
    for raw in re.split(r"\n\s*\n", path.read_text()):
        names = tuple(f or m or t for f, m, t in _DEFINES.findall(raw))
        if names:
            blocks.append((names, compact(raw)))
    return tuple(blocks)


def common_header(text: str) -> str:
    """The helpers of prelude_common.h that `text` (a kernel body) uses, with the helpers they use: each
    launch hashes its source, so a kernel carries only what it calls. Per-helper guards let several
    kernels' sources share one translation unit (the compile checks and the emulator)."""
    needed: set[int] = set()
    grew = True
    while grew:
        grew = False
        for i, (names, block) in enumerate(_common_helpers()):
            if i not in needed and any(re.search(rf"\b{n}\b", text) for n in names):
                needed.add(i)
                text += "\n" + block
                grew = True
    out = []
    for i, (names, block) in enumerate(_common_helpers()):
        if i in needed:
            guard = f"LILY_HELPER_{names[0].upper()}"
            out.append(f"#ifndef {guard}\n#define {guard}\n{block}#endif\n")
    return "".join(out)


@functools.lru_cache(maxsize=256)  # every instance of a spec shares its body, and the helper search is ~10 ms
def header(backend: str, body_text: str = "") -> str:
    """The backend's prelude, its tensor-core tile helpers if `body_text` multiplies tiles (lily_mma) and their
    direct-fragment ones if it calls those (lily_df_), its cross-block ordering if it calls that (lily_sync_), and
    the common helpers it needs."""
    _check_backend(backend)
    extra = read_source(f"mma_{backend}.h") if re.search(r"\blily_mma", body_text) else ""
    if re.search(r"\blily_df_", body_text):
        extra += read_source(f"mma_direct_{backend}.h")
    if re.search(r"\blily_sync_", body_text):
        extra += read_source(f"sync_{backend}.h")
    return read_source(f"prelude_{backend}.h") + extra + common_header(body_text)


_CONDITIONAL = re.compile(r"#\s*(ifdef|ifndef|if|else|elif|endif)\b\s*(\w*)")


def select_blocks(text: str, defines: Sequence[str]) -> str:
    """text with its `#ifdef LILY_X` / `#ifndef LILY_X` / `#else` / `#endif` blocks resolved for `defines`: one
    body serves kernel variants with different inputs, and each variant's source (which MLX hashes on every
    launch) holds only its own lines. Other conditionals pass through to the compiler."""
    out, stack = [], []  # stack: (ours, keep) per open conditional
    for line in text.splitlines():
        m = _CONDITIONAL.match(line.strip())
        kind = m.group(1) if m else None
        if kind in ("ifdef", "ifndef") and m.group(2).startswith("LILY_"):
            stack.append((True, (m.group(2) in defines) == (kind == "ifdef")))
            continue
        if kind in ("else", "endif") and stack and stack[-1][0]:
            ours, keep = stack.pop()
            if kind == "else":
                stack.append((True, not keep))
            continue
        if kind in ("ifdef", "ifndef", "if"):
            stack.append((False, True))
        elif kind == "endif" and stack:
            stack.pop()
        if all(keep for _, keep in stack):
            out.append(line)
    if stack:
        raise ValueError("kernel source: an #if block is not closed")
    return "\n".join(out) + "\n"


_INCLUDE = re.compile(r'^#include "(\w+\.inc)"$')
_SCOPED = re.compile(r"^#(define|undef) (LILY_\w+)$")
_MACRO = re.compile(r"^#(?:define (LILY_\w+)\s+\S|undef (LILY_\w+)$)")


def expand(filename: str, defines: Sequence[str]) -> str:
    """A body file with its blocks selected for `defines` and each `#include "other.inc"` line replaced by that
    body, expanded the same way (a chained kernel runs other kernels' bodies as its phases, unchanged). A body's
    bare `#define LILY_X` line, up to its `#undef LILY_X`, adds X to the defines of the bodies it includes
    (attn_chain.inc includes qmv.inc twice, the second time as qmv_attn); those two lines are not kept. A macro with
    a body (a chain's hook, such as LILY_QMV_AFTER_LOADS) is kept, and defined for the included bodies' #ifdef too."""
    out, scoped, macros = [], [], []
    for line in select_blocks(read_source(filename), defines).splitlines():
        m = _SCOPED.match(line)
        if m and (m.group(1) == "define" or m.group(2) in scoped):
            scoped = [d for d in scoped if d != m.group(2)] + ([m.group(2)] if m.group(1) == "define" else [])
        elif m := _INCLUDE.match(line):
            out.append(expand(m.group(1), (*defines, *scoped, *macros)).rstrip("\n"))
        else:
            if m := _MACRO.match(line):
                macros = [d for d in macros if d != (m.group(1) or m.group(2))] + ([m.group(1)] if m.group(1) else [])
            out.append(line)
    return "\n".join(out) + "\n"


def body(spec: KernelSpec, backend: str) -> str:
    _check_backend(backend)
    text = expand(spec.body, spec.defines)
    if spec.bundled_from:
        preamble = bundled_preamble(SPECS[spec.bundled_from], text)
    else:
        preamble = packed_preamble(spec, text) if spec.packed_from else ""
    return read_source(f"entry_{backend}.inc") + "\n" + preamble + text


DEFINES_ENV = "LILY_MLX_KERNEL_DEFINES"


@functools.lru_cache(maxsize=None)
def experiment_values() -> dict[str, str]:
    """$LILY_MLX_KERNEL_DEFINES ("NAME=VALUE,...") as {NAME: VALUE}: constants a kernel experiment sets where the
    headers default them with #ifndef (LILY_SYNC_SLEEP_NS, LILY_CHAIN_TRACE), with no new build of the package. A
    new value is new source, so MLX compiles it afresh."""
    text = os.environ.get(DEFINES_ENV, "").strip()
    values = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"LILY_[A-Z0-9_]+", name) or not re.fullmatch(r"[-+.\w]+", value):
            raise ValueError(f"{DEFINES_ENV}: {item!r} is not NAME=VALUE with NAME a LILY_* macro and VALUE one token")
        values[name] = value
    return values


PLAN_ENV = "LILY_MLX_PLAN"
PLANNED = {k: ("RPS", "WARPS") for k in ("qmv", "qmv_attn", "moe_gate_up", "moe_down_combine")}  # kernel -> its knobs
PLANNED["attn_chain"] = ("BLOCKS", "IN_RPS")  # the attention phase's blocks to aim for when it splits a cache, the
# input projection's rows a lane segment
PLANNED["attn_decode"] = ("STAGE_ROWS",)  # the cached positions a split needs for its rows to go through shared memory
PLANNED["deltanet_chain"] = ("IN_RPS", "OUT_RPS")  # rows a lane segment in its input and output projection phases
PLANNED["qmv"] += ("MAXREG",)  # a lane's registers capped in qmv's builds (a new build): more blocks an SM at 8 rows
PLAN_LIMITS = {"RPS": 8, "WARPS": 32, "BLOCKS": 4096, "STAGE_ROWS": 1 << 20, "IN_RPS": 8, "OUT_RPS": 8, "MAXREG": 255}
ANY_COUNT = ("IN_RPS", "OUT_RPS", "MAXREG")  # not only powers of two: a chained phase's blocks each take their rows
# in one pass; a register cap is any count


@functools.lru_cache(maxsize=None)
def plan_overrides() -> dict[str, dict[str, int]]:
    """$LILY_MLX_PLAN ("kernel.PARAM=N,...") as {kernel: {PARAM: N}}: a launch shape an experiment sets where a
    planner would choose it (a standalone kernel's rows a lane segment, warps a block), so a GPU run can time another
    shape with no new build. moe_chain's block follows moe_gate_up's plan; the other chains keep theirs, but for
    attn_chain.BLOCKS, the blocks its attention phase splits a long cache into (attn_chain.TARGET_BLOCKS), and
    attn_chain.IN_RPS, deltanet_chain.IN_RPS / OUT_RPS, the projection phases' rows a lane segment, and qmv.MAXREG, a
    lane's register cap (each a new build).
    One more choice: attn_decode.STAGE_ROWS, the positions a split needs to stage its rows."""
    text = os.environ.get(PLAN_ENV, "").strip()
    plans: dict[str, dict[str, int]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, eq, value = item.partition("=")
        kernel, dot, param = key.partition(".")
        if not eq or not dot or kernel not in PLANNED or param not in PLANNED[kernel]:
            raise ValueError(f"{PLAN_ENV}: {item!r} is not kernel.PARAM=N with kernel.PARAM one of "
                             + ", ".join(f"{k}.{p}" for k, ps in PLANNED.items() for p in ps))
        pow2 = param not in ANY_COUNT
        if not value.isdigit() or not 1 <= int(value) <= PLAN_LIMITS[param] or pow2 and int(value) & (int(value) - 1):
            raise ValueError(f"{PLAN_ENV}: {item!r}: {param} must be {'a power of two' if pow2 else 'a count'} from 1 "
                             f"to {PLAN_LIMITS[param]}")
        plans.setdefault(kernel, {})[param] = int(value)
    return plans


def experiment_defines() -> str:
    """experiment_values() as the #define lines put before every kernel's header."""
    return "".join(f"#define {n} {v}\n" for n, v in experiment_values().items())


def register_cap(spec: KernelSpec, template=None) -> int:
    """The CUDA register cap of a spec's instance (template arguments as pairs or a dict; 0: none, as for a cap that
    depends on them when they are not given)."""
    cap = spec.cuda_max_registers
    if callable(cap):
        return cap(dict(template)) if template is not None else 0
    return cap


def spec_header(spec: KernelSpec, backend: str, src: str, registers: Optional[int] = None) -> str:
    """header(backend, src) after experiment_defines(), with the spec's CUDA launch bounds and register cap last
    (registers: register_cap's for the instance; None: the spec's fixed cap)."""
    hdr = experiment_defines() + header(backend, src)
    registers = register_cap(spec) if registers is None else registers
    attributes, bounds = [], spec.cuda_launch_bounds
    if len(bounds) == 1 and registers:  # NVRTC takes no __maxnreg__ beside launch bounds: the cap as min blocks an SM
        bounds, registers = (bounds[0], max(1, SM_REGISTERS // (bounds[0] * registers))), 0
    if bounds:
        attributes.append(f"__launch_bounds__({', '.join(str(b) for b in bounds)})")
    if registers:
        attributes.append(f"__maxnreg__({registers})")
    if backend == "cuda" and attributes:
        hdr += f"#undef __global__\n#define __global__ __location__(global) {' '.join(attributes)}\n"
    return hdr


def full_source(spec: KernelSpec, backend: str, inst: Instance) -> tuple[str, str]:
    """(kernel name, the complete source MLX compiles for this instance on `backend`)."""
    write = metal_source.cuda_source if backend == "cuda" else metal_source.metal_source
    src = body(spec, backend)
    return write(spec.name, spec.input_names, spec.output_names, src,
                 spec_header(spec, backend, src, register_cap(spec, inst.template)), inst.inputs, inst.output_dtypes,
                 inst.template)


def source_dir() -> Optional[Path]:
    """Where CUDA kernel sources are written for NVRTC to #include ($LILY_MLX_KERNEL_CACHE, else the user's
    cache folder); None when it cannot be created (the sources then go inline)."""
    root = os.environ.get("LILY_MLX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lily_mlx", "kernels")
    path = Path(root).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) and '"' not in str(path) else None


def _content_file(folder: Path, text: str, suffix: str) -> Path:
    """text in folder/<sha256 prefix><suffix>, written once (atomically): the name changes with the content,
    so MLX's on-disk PTX cache, keyed by the hash of the inline text, never serves a stale kernel."""
    path = folder / (hashlib.sha256(text.encode()).hexdigest()[:24] + suffix)
    if not path.is_file() or path.read_text() != text:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def included(spec: KernelSpec, src: str, hdr: str, folder: Path) -> tuple[str, str]:
    """(body, header) as #include lines of files holding src and hdr. MLX hashes a CUDA custom kernel's
    inline text on every launch (about 0.3 us per KB on the H200, bench/launch_cost.py); NVRTC reads the
    files once. MLX passes an input's shape/strides/ndim only when the inline body names them, so the stub
    names what the file reads."""
    reads = [f"{n}_{s}" for n in spec.input_names for s in ("shape", "strides", "ndim") if f"{n}_{s}" in src]
    stub = f'#include "{_content_file(folder, src, ".inc")}"\n' + (f"// reads {' '.join(reads)}\n" if reads else "")
    return stub, f'#include "{_content_file(folder, hdr, ".h")}"\n'


@functools.lru_cache(maxsize=None)
def texts(name: str, backend: str, via_files: bool = False, registers: int = 0) -> tuple[str, str]:
    """(body, header) a registered spec's MLX kernel object is made from (CUDA: optionally #include stubs; registers:
    the instance's register_cap)."""
    spec = SPECS[name]
    src = body(spec, backend)
    hdr = spec_header(spec, backend, src, registers)
    folder = source_dir() if via_files and backend == "cuda" else None
    return included(spec, src, hdr, folder) if folder is not None else (src, hdr)


@functools.lru_cache(maxsize=None)
def build(name: str, backend: str, via_files: bool = False, shared_memory: int = 0, registers: int = 0):
    """The compiled-on-first-use MLX kernel object for a registered spec on a backend (CUDA: optionally
    with its source in #included files, `shared_memory` bytes of dynamic shared memory a launch and the instances'
    register cap)."""
    spec = SPECS[name]
    src, hdr = texts(name, backend, via_files, registers)
    if backend == "cuda":
        return mx.fast.cuda_kernel(name=name, input_names=list(spec.input_names),
                                   output_names=list(spec.output_names), source=src, header=hdr,
                                   shared_memory=shared_memory)
    return mx.fast.metal_kernel(name=name, input_names=list(spec.input_names),
                                output_names=list(spec.output_names), source=src, header=hdr)


def call(name: str, backend: str, inputs: Sequence[mx.array], template: Sequence[tuple[str, TemplateArg]],
         grid: tuple[int, int, int], threadgroup: tuple[int, int, int], output_shapes, output_dtypes,
         init_value: Optional[float] = None, shared_memory: int = 0) -> list[mx.array]:
    """Launches a registered kernel. shared_memory: the dynamic shared memory a CUDA body declares with
    LILY_SHARED_DYNAMIC (Metal sizes it in the source)."""
    spec = SPECS[name]
    if len(template) != len(spec.template_params) or any(n != p for (n, _), p in zip(template, spec.template_params)):
        raise ValueError(f"kernel {name!r}: template arguments {[n for n, _ in template]} != declared {spec.template_params}")
    if len(inputs) != len(spec.input_names):
        raise ValueError(f"kernel {name!r}: {len(inputs)} inputs given, expected {spec.input_names}")
    if spec.cuda_launch_bounds and threadgroup[0] * threadgroup[1] * threadgroup[2] > spec.cuda_launch_bounds[0]:
        raise ValueError(f"kernel {name!r}: a block of {threadgroup} threads, over its launch bound "
                         f"{spec.cuda_launch_bounds[0]}")
    from . import enabled

    if _CAPTURED is not None:
        _CAPTURED.append((spec, list(inputs)))
        return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
    swapped = None
    if spec.bundle and not spec.bundled_from and enabled("bundled_weights"):
        swapped = bundled_args(spec, inputs, template)
    if swapped is None and spec.weights and not spec.packed_from and enabled("packed_weights"):
        swapped = packed_args(spec, inputs, template)
    if swapped is not None:
        name, inputs, template = swapped
    return launch(name, backend, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value,
                  shared_memory if backend == "cuda" else 0)


_CAPTURED: Optional[list] = None


@contextlib.contextmanager
def captured():
    """Yields a list that collects (spec, inputs) of every call() inside, in order, with nothing launched: each call
    returns zeros of its outputs' shapes, lazily (what a trace of the launches needs, never evaluated)."""
    global _CAPTURED
    outer, _CAPTURED = _CAPTURED, []
    try:
        yield _CAPTURED
    finally:
        _CAPTURED = outer


def launch(name: str, backend: str, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
           init_value: Optional[float], shared_memory: int) -> list[mx.array]:
    """call's MLX launch, its arguments checked (and its weights swapped for their packed arrays)."""
    from . import enabled

    kwargs = {} if init_value is None else {"init_value": init_value}
    via_files = backend == "cuda" and enabled("cuda_source_files")
    if backend == "cuda" and enabled("kernel_cache"):
        cached_build(name, via_files, inputs, template, output_dtypes)
    registers = register_cap(SPECS[name], template) if backend == "cuda" else 0
    return build(name, backend, via_files, shared_memory, registers)(
        inputs=inputs, template=template, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
        output_dtypes=output_dtypes, **kwargs)


def launch_source(name: str, via_files: bool, inputs, template, output_dtypes) -> tuple[str, str]:
    """(kernel name, full source) MLX's cuda_kernel generates for this launch of a registered spec."""
    spec = SPECS[name]
    src, hdr = texts(name, "cuda", via_files, register_cap(spec, template))
    return metal_source.cuda_source(name, spec.input_names, spec.output_names, src, hdr,
                                    [(a.dtype, tuple(a.shape)) for a in inputs], output_dtypes, template)


def cached_build(name: str, via_files: bool, inputs, template, output_dtypes) -> None:
    """kernel_cache.ensure for this launch's instance."""
    from . import kernel_cache

    key = (name, via_files, tuple(template), tuple((a.dtype, a.ndim) for a in inputs), tuple(output_dtypes))
    if key not in kernel_cache._seen:
        kernel_cache.ensure(key, *launch_source(name, via_files, inputs, template, output_dtypes))
