"""A CUDA kernel built once per machine, not once per process.

MLX's `cuda_kernel` compiles a custom kernel with NVRTC at its first launch in every process, and never writes the
result to its on-disk cache (`get_jit_module(..., use_disk_cache=false)` in mlx/backend/cuda/custom_kernel.cpp),
though it reads that cache first: a fresh process pays seconds of NVRTC build a kernel instance before its first
token (3.6-5.8 s each for the 35B decode kernels on a 2-core VM; the H200's first compiled step took 12.9 s). So the
first launch of each kernel instance compiles it here, as MLX would (the same
source, NVRTC options and include paths), and writes the cubin where MLX looks for it:
`$MLX_PTX_CACHE_DIR/<module>.ptx` plus `<module>.txt` (kernel name, tab, lowered name), `<module>` being MLX's
`custom_kernel_<name><template>_<std::hash of the source, hex>`. Every later process loads it instead of compiling.
A new source is a new name, so a stale build is never loaded. MLX's device header `utils.cuh` is not shipped on
disk; the build takes a stand-in declaring what the kernels use of it (Shape, Strides: the same types, so the same
parameter layout).

Anything that fails here (no NVRTC library, a compile error, a cache folder that cannot be written) leaves the launch
to MLX's own build, as before.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

HASH_SEED = 0xC70F6907  # libstdc++'s std::hash<std::string> seed (std::_Hash_bytes)
HASH_MUL = 0xC6A4A7935BD1E995
MASK64 = (1 << 64) - 1
MAX_FILE_NAME = 245  # MLX splits longer module names into folders (get_ptx_path)

UTILS_STANDIN = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"

stats = {"loaded": 0, "built": 0, "failed": 0}  # instances found on disk, compiled here, left to MLX
_seen: dict[tuple, bool] = {}
_lock = threading.Lock()


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash of a std::string holding `data` (64-bit size_t): what MLX names a JIT module by."""
    n = len(data)
    h = (HASH_SEED ^ (n * HASH_MUL)) & MASK64
    aligned = n & ~7
    with np.errstate(over="ignore"):
        words = np.frombuffer(data[:aligned], dtype="<u8") * np.uint64(HASH_MUL)
        words ^= words >> np.uint64(47)
        words *= np.uint64(HASH_MUL)
    for w in words.tolist():
        h = ((h ^ w) * HASH_MUL) & MASK64
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * HASH_MUL) & MASK64
    h ^= h >> 47
    h = (h * HASH_MUL) & MASK64
    return h ^ (h >> 47)


def module_name(kernel_name: str, source: str) -> str:
    """MLX's name for the JIT module of a custom kernel (`<kernel name>_<hash of its full source, hex>`)."""
    return f"{kernel_name}_{std_hash(source.encode()):x}"


def cache_dir() -> Path:
    """Where MLX reads compiled kernels: $MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx as
    std::filesystem::temp_directory_path() finds <temp> ($TMPDIR, $TMP, $TEMP, $TEMPDIR, else /tmp)."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"])
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def ptx_path(cache: Path, name: str) -> Path:
    """MLX's file for module `name` (get_ptx_path: names past MAX_FILE_NAME characters become nested folders)."""
    if len(name) <= MAX_FILE_NAME:
        return cache / (name + ".ptx")
    path, offset = cache, 0
    while len(name) - offset > MAX_FILE_NAME:
        path, offset = path / name[offset:offset + MAX_FILE_NAME], offset + MAX_FILE_NAME
    return path / (name[offset:] + ".ptx")


def _write(path: Path, data: bytes) -> None:
    # A short temporary name: MLX's names already come up to MAX_FILE_NAME + 4 of the 255 a file name may have.
    tmp = path.with_name(f".lily-{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def store(path: Path, kernel: str, lowered: str, binary: bytes) -> None:
    """The module file pair MLX reads: the kernel's names first, then the binary, so a reader that finds the binary
    (what MLX checks first) also finds the names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path.with_suffix(".txt"), f"{kernel}\t{lowered}\n".encode())
    _write(path, binary)


class Nvrtc:
    """The NVRTC library MLX's CUDA backend loaded (or the CUDA toolkit's), through ctypes."""

    NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")

    def __init__(self, lib: Optional[ctypes.CDLL] = None):
        self.lib = lib or self._load()
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    @classmethod
    def _load(cls) -> ctypes.CDLL:
        """The loaded (MLX's) or a findable libnvrtc; else the one in the nvidia wheels beside MLX's package, its
        builtins library loaded first (NVRTC opens it by name at its first compile)."""
        site = Path(mx.__file__).resolve().parent.parent
        wheels = [d / "lib" for d in (site / "nvidia" / "cu13", site / "nvidia" / "cuda_nvrtc")]
        tried = list(cls.NAMES)
        for name in cls.NAMES:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
        for lib in wheels:
            for path in sorted(lib.glob("libnvrtc.so.*")):
                tried.append(str(path))
                try:
                    for builtins in sorted(lib.glob("libnvrtc-builtins.so.*")):
                        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                    return ctypes.CDLL(str(path))
                except OSError:
                    continue
        raise OSError(f"no NVRTC library found (tried {', '.join(tried)})")

    def _check(self, code: int, what: str, log: str = "") -> None:
        if code:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(code).decode()}{log}")

    def compile(self, source: str, program: str, kernel: str, options: list[str],
                headers: dict[str, str], log: Optional[list] = None) -> tuple[bytes, str]:
        """(cubin, or PTX where NVRTC cannot target the device's SASS; the lowered name of `kernel`). log: a list the
        compiler's log is appended to (ptxas's resource lines under --ptxas-options=-v)."""
        lib, prog = self.lib, ctypes.c_void_p()
        arr = lambda items: (ctypes.c_char_p * max(1, len(items)))(*[s.encode() for s in items])  # noqa: E731
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), program.encode(), len(headers),
                                           arr(list(headers.values())), arr(list(headers))), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            code = lib.nvrtcCompileProgram(prog, len(options), arr(options))
            if code or log is not None:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, text)
                self._check(code, "nvrtcCompileProgram", "\n" + text.value.decode(errors="replace")[-2000:])
                if log is not None:
                    log.append(text.value.decode(errors="replace"))
            lowered = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            name = lowered.value.decode()
            kind = "CUBIN" if self.sass else "PTX"
            size = ctypes.c_size_t()
            self._check(getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"nvrtcGet{kind}Size")
            out = ctypes.create_string_buffer(size.value)
            self._check(getattr(lib, f"nvrtcGet{kind}")(prog, out), f"nvrtcGet{kind}")
            return out.raw, name
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    @property
    def sass(self) -> bool:
        """NVRTC 11.8 on targets every SASS MLX runs on (MLX's compiler_supports_device_sass, for sm_90)."""
        return self.version >= (11, 8)


def device_arch() -> tuple[int, int]:
    info = mx.device_info()
    if "compute_capability_major" in info:
        return int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    arch = str(info.get("architecture", ""))
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise RuntimeError(f"no compute capability in mx.device_info(): {info}")
    return int(arch[3:-1]), int(arch[-1])


def nvrtc_options(nvrtc: Nvrtc, arch: tuple[int, int]) -> list[str]:
    """MLX's NVRTC options (jit_module.cpp compile() and include_path_args())."""
    root = Path(mx.__file__).resolve().parent
    target = f"--gpu-architecture={'sm' if nvrtc.sass else 'compute'}_{arch[0]}{arch[1]}{'a' if arch[0] >= 9 else ''}"
    paths = [p for p in (root / "include", root / "include" / "cccl") if p.exists()]
    cudart = root.parent / "nvidia" / ("cu13" if nvrtc.version[0] >= 13 else "cuda_runtime") / "include"
    if not cudart.exists():
        cudart = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return ["--device-as-default-execution-space", target, *(f"--include-path={p}" for p in (*paths, cudart))]


def offline_options(nvrtc: Nvrtc, folder: Path, arch: tuple[int, int] = (9, 0)) -> list[str]:
    """nvrtc_options for a machine without MLX's CUDA wheel (the CPU build, scripts/prebuild_kernels.py, the tests):
    the wheel's config.h written under `folder` (MAX_NDIM 10 sizes the Shape and Strides kernel parameters), the
    CUDA headers beside the NVRTC library."""
    device = folder / "mlx" / "backend" / "cuda" / "device"
    device.mkdir(parents=True, exist_ok=True)
    (device / "config.h").write_text("#pragma once\n#define MAX_NDIM 10\n#define WARP_SIZE 32\n")
    cuda = Path(nvrtc.lib._name).resolve().parent.parent / "include"
    target = f"--gpu-architecture=sm_{arch[0]}{arch[1]}{'a' if arch[0] >= 9 else ''}"
    return ["--device-as-default-execution-space", target, f"--include-path={folder}", f"--include-path={cuda / 'cccl'}",
            f"--include-path={cuda}"]


_compiler: Optional[tuple] = None
_unavailable: Optional[str] = None  # why nothing can be built here (said once)


def _build_tools() -> Optional[tuple]:
    global _compiler, _unavailable
    if _unavailable is not None:
        return None
    if _compiler is None:
        try:
            nvrtc = Nvrtc()
            _compiler = (nvrtc, nvrtc_options(nvrtc, device_arch()))
        except (OSError, RuntimeError, AttributeError) as e:
            _unavailable = str(e)
            warnings.warn(f"kernel_cache: kernels are left to MLX's own build in every process: {e}", stacklevel=4)
    return _compiler


def _writable(folder: Path) -> bool:
    """Whether builds can be stored in `folder` (made if missing); if not, said once and nothing more is built."""
    global _unavailable
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return True
        why = f"{folder} is not writable"
    except OSError as e:
        why = f"{folder}: {e}"
    _unavailable = why
    warnings.warn(f"kernel_cache: kernels are left to MLX's own build in every process: {why}", stacklevel=4)
    return False


def ensure(key: tuple, kernel_name: str, source: str) -> None:
    """Makes sure MLX will find `kernel_name`'s build of `source` on disk (key: what makes the source, checked once
    a process). A failure is reported once and leaves the build to MLX."""
    if key in _seen:
        return
    with _lock:
        if key in _seen:
            return
        try:
            path = ptx_path(cache_dir(), module_name(kernel_name, source))
            if path.is_file() and path.with_suffix(".txt").is_file():
                stats["loaded"] += 1
            elif _build_tools() is None or not _writable(path.parent):
                stats["failed"] += 1
            else:
                nvrtc, options = _compiler
                full = "mlx::core::cu::" + kernel_name
                binary, lowered = nvrtc.compile(source, path.stem + ".cu", full, options, {UTILS_NAME: UTILS_STANDIN})
                store(path, full, lowered, binary)
                stats["built"] += 1
            _seen[key] = True
        except Exception as e:  # noqa: BLE001 - any failure leaves the build to MLX
            stats["failed"] += 1
            _seen[key] = False
            warnings.warn(f"kernel_cache: {kernel_name} left to MLX's own build: {e}", stacklevel=3)
