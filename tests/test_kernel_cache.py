"""ops/kernel_cache.py: CUDA kernels built once per machine into the on-disk cache MLX reads.

CPU: MLX's module naming (libstdc++'s std::hash against g++'s own, the cache folder, the long-name split), and a
launch's build stored where and as MLX reads it, through a stand-in compiler. `cuda`: MLX loads a file stored under
the computed name (a planted build that writes other values proves it), and a cached kernel's outputs equal MLX's own
build's, in fresh processes.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

import script_tool
from emulator import GXX
from lily_mlx import ops
from lily_mlx.ops import kernel_cache, kernels, qmv

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(GXX is None, reason="g++ is not installed")
def test_std_hash_is_libstdcxx(tmp_path):
    """Every length mod 8, empty, long, non-ASCII, and a real kernel source: the hash g++'s std::hash gives."""
    rng = np.random.default_rng(0)
    blobs = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (*range(18), 64, 1000, 4097)]
    spec = kernels.SPECS["moe_chain"]
    blobs += [b"", "é∑ kernel".encode(), kernels.full_source(spec, "cuda", spec.instances()[0])[1].encode()]
    files = []
    for i, b in enumerate(blobs):
        files.append(tmp_path / f"{i}.bin")
        files[-1].write_bytes(b)
    prog = tmp_path / "h.cpp"
    prog.write_text('#include <fstream>\n#include <iostream>\n#include <sstream>\n#include <string>\n'
                    'int main(int argc, char** argv) { for (int i = 1; i < argc; ++i) { std::ifstream f(argv[i], '
                    'std::ios::binary); std::stringstream s; s << f.rdbuf(); '
                    'std::cout << std::hex << std::hash<std::string>{}(s.str()) << "\\n"; } }\n')
    subprocess.run([GXX, "-O1", "-o", str(tmp_path / "h"), str(prog)], check=True)
    out = subprocess.run([str(tmp_path / "h"), *map(str, files)], check=True, capture_output=True, text=True).stdout
    assert out.split() == [format(kernel_cache.std_hash(b), "x") for b in blobs]


def test_cache_folder_and_file_names_follow_mlx(monkeypatch, tmp_path):
    for var in ("MLX_PTX_CACHE_DIR", "TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(var, raising=False)
    assert kernel_cache.cache_dir() == Path("/tmp/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("TEMP", "/t2")
    monkeypatch.setenv("TMP", "/t1")
    assert kernel_cache.cache_dir() == Path("/t1/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path
    assert kernel_cache.ptx_path(tmp_path, "k" * 245) == tmp_path / ("k" * 245 + ".ptx")
    long = "".join(chr(97 + i % 26) for i in range(600))
    assert kernel_cache.ptx_path(tmp_path, long) == tmp_path / long[:245] / long[245:490] / (long[490:] + ".ptx")
    for name in (long, long[:245]):  # the longest file names MLX makes can be stored
        path = kernel_cache.ptx_path(tmp_path, name)
        kernel_cache.store(path, "k", "_Zk", b"cubin")
        assert path.read_bytes() == b"cubin" and path.with_suffix(".txt").read_text() == "k\t_Zk\n"
    assert kernel_cache.module_name("custom_kernel_qmv_t_3", "abc") == \
        f"custom_kernel_qmv_t_3_{kernel_cache.std_hash(b'abc'):x}"


class FakeNvrtc:
    """kernel_cache's compiler without NVRTC: records what it is asked to build."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def compile(self, source, program, kernel, options, headers):
        self.calls.append((source, program, kernel, options, headers))
        if self.fail:
            raise RuntimeError("nvrtcCompileProgram: NVRTC_ERROR_COMPILATION")
        return b"\x7fELF cubin of " + kernel.encode(), "_ZN3mlx4core2cu" + kernel.rsplit(":", 1)[-1]


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_seen", {})
    monkeypatch.setattr(kernel_cache, "stats", {"loaded": 0, "built": 0, "failed": 0})
    monkeypatch.setattr(kernel_cache, "_unavailable", None)
    return tmp_path


def _qmv_launch(dtype=mx.bfloat16):
    """kernels.launch of one qmv instance as the CUDA path makes it (MLX's kernel object a stand-in), and the
    (kernel name, full source) MLX's cuda_kernel would generate for it."""
    inst = qmv.instance(dtype, dtype, 1, 256, 96, 4, 64)
    spec = kernels.SPECS["qmv"]
    inputs = [mx.zeros(s, dtype=d) for d, s in inst.inputs]
    with mock.patch.object(kernels, "build", lambda *a: lambda **kw: ["launched"]):
        out = kernels.launch("qmv", "cuda", inputs, inst.template, (256, 1, 1), (256, 1, 1),
                             [s for _, s in inst.inputs[:1]], inst.output_dtypes, None, 0)
    assert out == ["launched"]
    return kernels.full_source(spec, "cuda", inst)


def test_a_launch_stores_its_build_where_mlx_reads_it_once(fresh_cache, monkeypatch):
    fake = FakeNvrtc()
    monkeypatch.setattr(kernel_cache, "_compiler", (fake, ["--device-as-default-execution-space"]))
    with ops.switched("kernel_cache", True):
        kname, source = _qmv_launch()
        _qmv_launch()  # the same instance: nothing more
    assert kernel_cache.stats == {"loaded": 0, "built": 1, "failed": 0} and len(fake.calls) == 1
    src, program, full, options, headers = fake.calls[0]
    assert src == source and full == "mlx::core::cu::" + kname and options == ["--device-as-default-execution-space"]
    assert headers == {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN}
    path = kernel_cache.ptx_path(fresh_cache, kernel_cache.module_name(kname, source))
    assert program == path.stem + ".cu"
    assert path.read_bytes() == b"\x7fELF cubin of " + full.encode()
    assert path.with_suffix(".txt").read_text() == f"{full}\t_ZN3mlx4core2cu{kname}\n"
    assert sorted(p.name for p in fresh_cache.iterdir()) == sorted([path.name, path.with_suffix(".txt").name])

    monkeypatch.setattr(kernel_cache, "_seen", {})  # another process: found, not built
    with ops.switched("kernel_cache", True):
        _qmv_launch()
    assert kernel_cache.stats["loaded"] == 1 and len(fake.calls) == 1
    with ops.switched("kernel_cache", False):  # off: nothing asked
        _qmv_launch(mx.float32)
    assert len(fake.calls) == 1


def test_a_failed_build_is_left_to_mlx(fresh_cache, monkeypatch):
    monkeypatch.setattr(kernel_cache, "_compiler", (FakeNvrtc(fail=True), []))
    with ops.switched("kernel_cache", True), pytest.warns(UserWarning, match="left to MLX's own build"):
        _qmv_launch()
    assert kernel_cache.stats["failed"] == 1 and not any(fresh_cache.iterdir())
    monkeypatch.setattr(kernel_cache, "_compiler", None)  # no NVRTC at all (this machine): said once, then quiet
    monkeypatch.setattr(kernel_cache, "_seen", {})
    monkeypatch.setattr(kernel_cache.Nvrtc, "_load", classmethod(lambda cls: (_ for _ in ()).throw(OSError("no NVRTC"))))
    with ops.switched("kernel_cache", True), pytest.warns(UserWarning, match="no NVRTC"):
        _qmv_launch()
        _qmv_launch(mx.float32)
    assert kernel_cache.stats["failed"] == 3 and not any(fresh_cache.iterdir())


def test_an_unusable_cache_folder_builds_nothing(fresh_cache, monkeypatch):
    """A cache folder that cannot be made is said once; nothing is built for it (a build would be lost)."""
    (fresh_cache / "file").write_text("")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(fresh_cache / "file" / "ptx"))
    fake = FakeNvrtc()
    monkeypatch.setattr(kernel_cache, "_compiler", (fake, []))
    with ops.switched("kernel_cache", True), pytest.warns(UserWarning, match="file/ptx") as said:
        _qmv_launch()
        _qmv_launch(mx.float32)
    assert len(said) == 1 and not fake.calls and kernel_cache.stats["failed"] == 2


def _nvrtc():
    try:
        return kernel_cache.Nvrtc()
    except OSError as e:
        pytest.skip(f"{e}: pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85")


def test_nvrtc_builds_the_chains_with_the_standin_header(tmp_path):
    """kernel_cache's NVRTC build of real kernel sources (a qmv, the three chains bundled), no GPU needed: a cubin
    for sm_90a and the kernel's lowered name, with MLX's options and the stand-in for MLX's utils.cuh over a config.h
    like the CUDA wheel's (MAX_NDIM 10: the layout of Shape and Strides kernel parameters)."""
    nvrtc = _nvrtc()
    options = kernel_cache.offline_options(nvrtc, tmp_path)
    assert "--gpu-architecture=sm_90a" in options and (tmp_path / "mlx/backend/cuda/device/config.h").is_file()
    for name in ("qmv", "moe_chain_pb", "deltanet_chain_out_pb", "attn_chain_pb"):
        spec = kernels.SPECS[name]
        kname, source = kernels.full_source(spec, "cuda", spec.instances()[-1])
        binary, lowered = nvrtc.compile(source, name + ".cu", "mlx::core::cu::" + kname, options,
                                        {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN})
        assert binary[:4] == b"\x7fELF" and lowered.startswith("_ZN3mlx4core2cu") and kname in lowered, name
    with pytest.raises(RuntimeError, match="(?s)nvrtcCompileProgram: NVRTC_ERROR_COMPILATION.*undefined_thing"):
        nvrtc.compile("__global__ void k() { undefined_thing(); }", "bad.cu", "k", options, {})


GPU_SCRIPT = textwrap.dedent('''
    import sys, numpy as np, mlx.core as mx
    from lily_mlx import ops
    from lily_mlx.ops import kernel_cache, metal_source, qmv
    body = "out[threadIdx.x] = static_cast<float>(threadIdx.x) + inp[0];"
    what = sys.argv[1]
    if what in ("plant", "planted"):  # MLX loads what sits under the name computed here
        x = mx.array([0.5])
        if what == "plant":
            kname, source = metal_source.cuda_source("probe", ["inp"], ["out"], body, "", [(mx.float32, (1,))],
                                                     [mx.float32])
            other = source.replace("+ inp[0]", "* 0.0f + 42.0f")
            nvrtc = kernel_cache.Nvrtc()
            opts = kernel_cache.nvrtc_options(nvrtc, kernel_cache.device_arch())
            full = "mlx::core::cu::" + kname
            binary, lowered = nvrtc.compile(other, "probe.cu", full, opts, {kernel_cache.UTILS_NAME: kernel_cache.UTILS_STANDIN})
            kernel_cache.store(kernel_cache.ptx_path(kernel_cache.cache_dir(), kernel_cache.module_name(kname, source)),
                               full, lowered, binary)
        k = mx.fast.cuda_kernel(name="probe", input_names=["inp"], output_names=["out"], source=body)
        (y,) = k(inputs=[x], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
        print(" ".join(str(v) for v in np.array(y)[:3].tolist()))
    else:  # a qmv through the cache (built here, or loaded) against MLX's own build
        rng = np.random.default_rng(0)
        w = mx.array(rng.integers(0, 2**32, (96, 32), dtype=np.uint32))
        s = mx.array(rng.uniform(0.01, 0.02, (96, 4)).astype(np.float32)).astype(mx.bfloat16)
        b = mx.array(rng.uniform(-0.1, 0.1, (96, 4)).astype(np.float32)).astype(mx.bfloat16)
        x = mx.array(rng.standard_normal((1, 256)).astype(np.float32)).astype(mx.bfloat16)
        with ops.switched("kernel_cache", what == "cached"):
            y = qmv.qmv(x, w, s, b, group_size=64, bits=4, backend="cuda")
        mx.eval(y)
        np.save(sys.argv[2], np.array(y.astype(mx.float32)))
        print(kernel_cache.stats)
''')


def _run_gpu(cache: Path, *args, ok: bool = True) -> str:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache), PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", GPU_SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)
    assert (r.returncode == 0) == ok, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1] if ok else r.stderr


@pytest.mark.cuda
def test_mlx_loads_the_build_stored_under_its_name_cuda(tmp_path):
    """A build of another body planted under the computed name is what MLX runs (so the name is MLX's); without
    it MLX builds the body itself."""
    assert _run_gpu(tmp_path / "a", "plant") == "42.0 42.0 42.0"
    assert _run_gpu(tmp_path / "a", "planted") == "42.0 42.0 42.0"  # a later process loads it too
    assert _run_gpu(tmp_path / "b", "planted") == "0.5 1.5 2.5"


@pytest.mark.cuda
def test_cached_kernel_equals_mlx_build_cuda(tmp_path):
    """qmv built by kernel_cache in one process and loaded by the next: outputs bit-equal to MLX's own build. Then
    the stored lowered name is spoilt, and a process with the cache off fails to find the kernel: MLX did read the
    file kernel_cache named for a templated lily kernel."""
    cache = tmp_path / "c"
    assert "'built': 0" in _run_gpu(cache, "mlx", str(tmp_path / "own.npy"))
    assert "'built': 1" in _run_gpu(cache, "cached", str(tmp_path / "built.npy"))
    assert "'loaded': 1" in _run_gpu(cache, "cached", str(tmp_path / "loaded.npy"))
    ref = np.load(tmp_path / "own.npy")
    assert np.array_equal(np.load(tmp_path / "built.npy"), ref) and np.array_equal(np.load(tmp_path / "loaded.npy"), ref)
    (names,) = list(cache.rglob("*.txt"))
    names.write_text(names.read_text().split("\t")[0] + "\tlily_no_such_kernel\n")
    assert "cuModuleGetFunction" in _run_gpu(cache, "mlx", str(tmp_path / "spoilt.npy"), ok=False)


def test_prebuild_configurations_are_ones_the_variables_accept(kernel_env):
    """Every configuration scripts/prebuild_kernels.py builds names registered switches, a LILY_MLX_PLAN and a
    LILY_MLX_KERNEL_DEFINES the package accepts: a removed experiment left there fails here, not four minutes into a
    build."""
    tool = script_tool.load("prebuild_kernels")
    for switches, plan, defines, *_ in tool.CONFIGS + tool.VERIFY_CONFIGS:
        for name in filter(None, switches.split(",")):
            assert name.lstrip("-") in ops.KERNEL_NAMES, f"prebuild_kernels.py: {name!r} is no switch"
        kernel_env(kernels.PLAN_ENV, plan or None)
        kernels.plan_overrides()
        kernel_env(kernels.DEFINES_ENV, defines or None)
        kernels.experiment_values()
