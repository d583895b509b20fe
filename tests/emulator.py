"""Kernels' Metal sources run on the CPU by the shim's SIMT emulator (tests/metal_shim).

No Apple GPU is reachable, so this is how CI runs the Metal face of every kernel: the full source MLX
would build (lily_mlx.ops.metal_source), compiled with g++ against the shim, one fiber per GPU
thread, simdgroups of 32. Outputs start as NaN bytes (0xff), so an unwritten element stays NaN. Where g++ can link
AddressSanitizer, every buffer (inputs, outputs, threadgroup arrays) is bounds-checked: a kernel reading or
writing past one fails its case.

    emu = Emulator(tmp_path)
    case = emu.add(spec, inst, [x, w, ...], grid, threadgroup, [(M, N)])
    outs = emu.run()[case]          # mx arrays in the instance's output dtypes
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from lily_mlx.ops import kernels, metal_source, packing

SHIM_DIR = Path(__file__).parent / "metal_shim"
ATTRIBUTE = re.compile(r"\[\[[^\[\]]*\]\]")
GXX = shutil.which("g++")

MAIN = """
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
static std::vector<char> load(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) { std::perror(path.c_str()); std::exit(2); }
  std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
  std::vector<char> buf(n);
  if (std::fread(buf.data(), 1, n, f) != size_t(n)) std::exit(3);
  std::fclose(f);
  return buf;
}
static void save(const std::string& path, const std::vector<char>& buf) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(buf.data(), 1, buf.size(), f);
  std::fclose(f);
}
int main(int argc, char** argv) {
  const int which = std::atoi(argv[1]);
  const std::string dir = argv[2];
  switch (which) {
CASES
  default: return 1;
  }
  return 0;
}
"""


# LeakSanitizer cannot run under ptrace (some CI sandboxes), and the emulator's leaks would not be the kernels'.
SANITIZER_ENV = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")


def run(cmd, cwd=None, timeout=900, env=None) -> tuple[int, str]:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return r.returncode, (r.stdout + r.stderr)[-8000:]


@functools.cache
def sanitizer_flags() -> tuple[str, ...]:
    """("-fsanitize=address",) where g++ builds and runs a program with it, else (): the emulator's bounds checks."""
    if GXX is None:
        return ()
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text("int main() { return 0; }\n")
        built = run([GXX, "-fsanitize=address", str(src), "-o", str(exe)])[0] == 0
        return ("-fsanitize=address",) if built and run([str(exe)], env=SANITIZER_ENV)[0] == 0 else ()


def metal_unit(spec, instances) -> str:
    """The shim and the Metal sources of `instances` of `spec`, attributes stripped: one C++ unit."""
    parts = ['#include "metal_shim.h"\n']
    for inst in instances:
        _, src = kernels.full_source(spec, "metal", inst)
        parts.append(ATTRIBUTE.sub("", src))
    return "\n".join(parts)


def to_numpy(a: mx.array) -> np.ndarray:
    """The raw bytes MLX holds (16-bit floats as their bit patterns)."""
    return np.array(a.view(mx.uint16)) if a.dtype in (mx.bfloat16, mx.float16) else np.array(a)


def _from_file(path: Path, dtype: mx.Dtype, shape) -> mx.array:
    if dtype in (mx.bfloat16, mx.float16):
        return mx.array(np.fromfile(path, dtype=np.uint16).reshape(shape)).view(dtype)
    np_dtype = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32}[dtype]
    return mx.array(np.fromfile(path, dtype=np_dtype).reshape(shape))


def case_source(case: int, spec, inst, kname: str, arrays, grid, group, out_shapes, reversed_groups: bool = False,
                read_back: tuple = ()) -> str:
    """The C++ for one case of main(): load inputs, poison outputs with NaN bytes, launch, save the outputs, then the
    inputs listed in read_back (a kernel may write an input: counters it leaves as it found them)."""
    src = kernels.body(spec, "metal")
    infos = [(f"{n}_shape" in src, f"{n}_strides" in src, f"{n}_ndim" in src) for n in spec.input_names]
    attrs = [a for a, _ in metal_source.METAL_ATTRIBUTES if a in src]
    lines, args = [f"  case {case}: {{"], []
    for i, (a, n, info) in enumerate(zip(arrays, spec.input_names, infos)):
        t = metal_source.type_string(a.dtype)
        lines.append(f'    auto in{i} = load(dir + "/{case}_in{i}.bin");')
        args.append(f"*reinterpret_cast<const {t}*>(in{i}.data())" if a.ndim == 0 else f"reinterpret_cast<const {t}*>(in{i}.data())")
        if a.ndim:
            if info[0]:
                lines.append(f"    static const int {n}_shape[] = {{{', '.join(map(str, a.shape))}}};")
                args.append(f"{n}_shape")
            if info[1]:
                strides = [math.prod(a.shape[j + 1:]) for j in range(a.ndim)]
                lines.append(f"    static const int64_t {n}_strides[] = {{{', '.join(map(str, strides))}}};")
                args.append(f"{n}_strides")
            if info[2]:
                lines.append(f"    static const int {n}_ndim = {a.ndim};")
                args.append(f"{n}_ndim")
    for o, (shape, dtype) in enumerate(zip(out_shapes, inst.output_dtypes)):
        t = metal_source.type_string(dtype)
        lines.append(f"    std::vector<char> out{o}({math.prod(shape)} * sizeof({t}), char(0xff));")
        args.append(f"reinterpret_cast<{t}*>(out{o}.data())")
    args += [f"ids.{a}" for a in attrs]
    targs = ", ".join(metal_source.type_string(v) if isinstance(v, mx.Dtype) else str(int(v)) for _, v in inst.template)
    lines.append(f"    metal_sim::launch(uint3({grid[0]}u, {grid[1]}u, {grid[2]}u), uint3({group[0]}u, {group[1]}u, {group[2]}u),")
    lines.append(f"        [&](const metal_sim::Ids& ids) {{ {kname}<{targs}>({', '.join(args)}); }}, {str(reversed_groups).lower()});")
    lines += [f'    save(dir + "/{case}_out{o}.bin", out{o});' for o in range(len(out_shapes))]
    lines += [f'    save(dir + "/{case}_out{len(out_shapes) + j}.bin", in{i});' for j, i in enumerate(read_back)]
    lines.append("  } break;")
    return "\n".join(lines)


def packed_launch(spec, inst, arrays, read_back: tuple = ()):
    """(spec's packed variant, its instance, its inputs, read_back renumbered) for a launch of spec: each weight
    packed, then swapped as kernels.call swaps it (kernels.packed_args)."""
    views = list(arrays)
    for triple in spec.weights:
        at = [spec.input_names.index(n) for n in triple]
        for i, v in zip(at, packing.pack(*(arrays[i] for i in at))[1:]):
            views[i] = v
    name, inputs, template = kernels.packed_args(spec, views, inst.template)
    packed_inst = kernels.packed_instance(spec, inst)  # the build's shapes (bucketed rows), not the launch's
    assert packed_inst.template == tuple(template), f"{spec.name}: the launch's template is not the build's"
    back = tuple(next(j for j, a in enumerate(inputs) if a is views[i]) for i in read_back)
    return kernels.SPECS[name], packed_inst, inputs, back


def bundled_launch(spec, inst, arrays, read_back: tuple = ()):
    """(spec's bundled variant, its instance, its inputs, read_back renumbered) for a launch of spec: its constant
    inputs bundled, then swapped as kernels.call swaps them (kernels.bundled_args)."""
    named = dict(zip(spec.input_names, arrays))
    members = kernels.bundle_members(spec, named)
    triples = kernels.weight_triples(spec)
    for m, view in zip(spec.bundle, packing.bundle(members)[1]):
        named.update(zip(triples[m], view) if m in triples else [(m, view)])
    views = [named[n] for n in spec.input_names]
    name, inputs, template = kernels.bundled_args(spec, views, inst.template)
    bundled_inst = kernels.bundled_instance(spec, inst)
    assert bundled_inst.template == tuple(template), f"{spec.name}: the launch's template is not the build's"
    back = tuple(next(j for j, a in enumerate(inputs) if a is views[i]) for i in read_back)
    return kernels.SPECS[name], bundled_inst, inputs, back


class Emulator:
    """Collects launches of any registered kernels, builds one emulator binary, runs every case."""

    def __init__(self, tmp_path: Path, packed_twins: bool = False):
        """packed_twins: each launch whose quantized weights pack is run again through its kernel's packed variant
        (ops/packing.py), and through its bundled variant where it has one, and run() checks each twin bit for bit
        against the launch."""
        self.dir = Path(tmp_path)
        self.sources: dict[str, str] = {}
        self.calls: list[str] = []
        self.outputs: list[list[tuple[tuple, mx.Dtype]]] = []
        self.packed_twins = packed_twins
        self.plain: list[int] = []  # the internal case of each add(), in order
        self.twins: list[tuple[int, int, str]] = []  # (internal case, its twin's, "packed" or "bundled")

    def add(self, spec, inst, arrays, grid, group, out_shapes, reversed_groups: bool = False,
            read_back: tuple = ()) -> int:
        """One launch (grid and group in threads, as MLX takes them), its threadgroups and each group's threads in
        index order or reversed.
        Returns the case number; its results are the outputs, then the inputs in `read_back` as the launch left them."""
        n = self._add(spec, inst, arrays, grid, group, out_shapes, reversed_groups, read_back, None)
        self.plain.append(n)
        if self.packed_twins and spec.weights and all(
                packing.why_not(*(arrays[spec.input_names.index(name)] for name in t)) is None for t in spec.weights):
            for twin in ("packed", "bundled") if spec.bundle else ("packed",):
                self.twins.append((n, self._add(spec, inst, arrays, grid, group, out_shapes, reversed_groups,
                                                read_back, twin), twin))
        return len(self.plain) - 1

    def _add(self, spec, inst, arrays, grid, group, out_shapes, reversed_groups, read_back, twin) -> int:
        if twin is not None:
            variant = packed_launch if twin == "packed" else bundled_launch
            spec, inst, arrays, read_back = variant(spec, inst, arrays, read_back)
        n = len(self.calls)
        for i, a in enumerate(arrays):
            to_numpy(a).tofile(self.dir / f"{n}_in{i}.bin")
        kname, src = kernels.full_source(spec, "metal", inst)
        self.sources[kname] = ATTRIBUTE.sub("", src)
        self.calls.append(case_source(n, spec, inst, kname, arrays, grid, group, out_shapes, reversed_groups, read_back))
        self.outputs.append([(tuple(s), d) for s, d in zip(out_shapes, inst.output_dtypes)]
                            + [(arrays[i].shape, arrays[i].dtype) for i in read_back])
        return n

    def run(self) -> list[list[mx.array]]:
        unit = self.dir / "emulate.cpp"
        unit.write_text("#define METAL_SHIM_SIM 1\n" + '#include "metal_shim.h"\n' + "\n".join(self.sources.values())
                        + MAIN.replace("CASES", "\n".join(self.calls)))
        exe = self.dir / "emulate"
        rc, log = run([GXX, "-std=c++20", "-O0", *sanitizer_flags(), "-Wno-attributes", f"-I{SHIM_DIR}", str(unit),
                       "-o", str(exe)])
        assert rc == 0, f"emulator build failed:\n{log}"
        results = []
        for n, outs in enumerate(self.outputs):
            rc, log = run([str(exe), str(n), str(self.dir)], timeout=300, env=SANITIZER_ENV)
            assert rc == 0, f"emulated case {n} failed:\n{log}"
            results.append([_from_file(self.dir / f"{n}_out{o}.bin", d, s) for o, (s, d) in enumerate(outs)])
        if self.packed_twins:
            assert self.twins, "packed_twins: no launch had weights that pack"
            for n, t, twin in self.twins:
                for o, (a, b) in enumerate(zip(results[n], results[t])):
                    assert np.array_equal(to_numpy(a), to_numpy(b), equal_nan=True), \
                        f"case {n}: output {o} differs with its weights {twin}"
        return [results[n] for n in self.plain]
