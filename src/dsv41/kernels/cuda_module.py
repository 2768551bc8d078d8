"""Build, cache and launch dsv41's CUDA kernels (no torch C++ extension: plain cubins through the driver API).

A kernel file is built once per set of `-D` defines and GPU architecture. Lookup order: a prebuilt cubin in
`$DSV41_CUBIN_DIR` (the Nix closure ships every variant for the appliance's GPUs, `dsv41.kernels.cuda_build`), the
cache `$DSV41_HOME/cuda` (default `~/.cache/dsv41/cuda`), else a fresh build: `nvcc -cubin` when a CUDA toolkit is
found (`$DSV41_NVCC`, `nvcc` on PATH, `/usr/local/cuda/bin/nvcc`), else NVRTC to PTX (torch's bundled NVRTC) that
the driver finishes. Launches go through `cuLaunchKernel(Ex)` on torch's current stream, so they are captured by
CUDA graphs like any torch kernel.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41.kernels.cuda_build import SOURCE_DIR, find_nvcc, flags_of, image_name, nvcc_cubin
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: enum id, padding to 8 bytes, a 64-byte value union
    # (the union as 16 uints: a c_char array would stop copying at the first zero byte)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [
        ("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
        ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]


def pdl_enabled(device_index: int) -> bool:
    """Programmatic dependent launch (kernels start while the previous one drains): sm_90+ and DSV41_CUDA_PDL != 0.

    The kernels prefetch only weights before `griddepcontrol.wait`; weights are never written by a kernel.
    """
    if os.environ.get("DSV41_CUDA_PDL", "1") in ("0", ""):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


class CudaBuildError(RuntimeError):
    """A kernel could not be compiled or loaded (the message carries the compiler's output)."""


def cache_dir() -> Path:
    home = Path(os.environ.get("DSV41_HOME", Path.home() / ".cache" / "dsv41"))
    return home / "cuda"


def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
_SHARED_LIMITS: dict[int, int] = {}


def shared_memory_limit(device_index: int) -> int:
    """Most dynamic shared memory one block may opt in to on the device (227 KB on Hopper, 99 KB on GB10)."""
    with _LOCK:
        if device_index not in _SHARED_LIMITS:
            if not _DRIVER:
                _DRIVER.append(_driver())
            lib = _DRIVER[0]
            torch.cuda.init()
            dev, value = ctypes.c_int(), ctypes.c_int()
            _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            _check(lib, lib.cuDeviceGetAttribute(ctypes.byref(value),
                                                 _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
                   "shared memory per block (opt-in)")
            _SHARED_LIMITS[device_index] = value.value
        return _SHARED_LIMITS[device_index]


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(msg))
        raise CudaBuildError(f"{what}: CUDA driver error {code} ({(msg.value or b'?').decode()})")


def compile_image(source: Path, defines: dict[str, int], arch: str) -> bytes:
    """cubin (prebuilt, cached or nvcc) or PTX (NVRTC) bytes for `source` with `defines`."""
    cubin = image_name(source, defines, arch, "cubin")
    prebuilt = os.environ.get("DSV41_CUBIN_DIR")
    for folder in ([Path(prebuilt)] if prebuilt else []) + [cache_dir()]:
        if (folder / cubin).is_file():
            return (folder / cubin).read_bytes()
    nvcc = find_nvcc()
    cache_dir().mkdir(parents=True, exist_ok=True)
    if nvcc:
        try:
            nvcc_cubin(nvcc, source, defines, arch, cache_dir() / cubin)
        except RuntimeError as exc:
            raise CudaBuildError(str(exc)) from None
        return (cache_dir() / cubin).read_bytes()
    ptx_path = cache_dir() / image_name(source, defines, arch, "ptx")
    if ptx_path.is_file():
        return ptx_path.read_bytes()
    from torch.cuda._utils import _nvrtc_compile  # torch's NVRTC binding (no toolkit needed)

    ptx, _ = _nvrtc_compile(source.read_text(), "exl3_linear_r8", arch.removeprefix("sm_"),
                            nvcc_options=["-std=c++17", *flags_of(defines)])
    ptx_path.write_bytes(ptx)
    return ptx


@dataclass
class CudaKernel:
    name: str
    function: ctypes.c_void_p
    pdl: bool = False
    shared_limit: int = 48 * 1024
    _occupancy: dict = field(default_factory=dict)
    _nonportable: bool = False

    def _allow_shared(self, shared: int) -> None:
        if shared > self.shared_limit:
            lib = _DRIVER[0]
            _check(lib, lib.cuFuncSetAttribute(self.function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               ctypes.c_int(shared)), f"{self.name}: shared memory {shared} B")
            self.shared_limit = shared

    def resident_blocks_per_sm(self, block: int, shared: int) -> int:
        """How many blocks of this kernel fit on one SM at once (registers, shared memory, threads)."""
        key = (block, shared)
        if key not in self._occupancy:
            self._allow_shared(shared)
            lib, count = _DRIVER[0], ctypes.c_int()
            _check(lib, lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(count), self.function, block,
                                                                        ctypes.c_size_t(shared)),
                   f"{self.name}: occupancy")
            self._occupancy[key] = count.value
        return self._occupancy[key]

    def launch(self, grid: tuple[int, int, int], block: int, shared: int, args: list,
               cluster: tuple[int, int, int] | None = None) -> None:
        lib = _DRIVER[0]
        self._allow_shared(shared)
        values = []
        for a in args:
            if isinstance(a, torch.Tensor):
                values.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, (ctypes._SimpleCData, ctypes.Structure)):
                values.append(a)  # a structure goes by value, its bytes the kernel parameter's
            elif isinstance(a, float):
                values.append(ctypes.c_float(a))
            else:
                values.append(ctypes.c_int(int(a)))
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not self.pdl and cluster is None:
            _check(
                lib,
                lib.cuLaunchKernel(self.function, *grid, block, 1, 1, shared, stream, pointers, None),
                f"launch {self.name}",
            )
            return
        attrs = []
        if self.pdl:
            attrs.append((_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
        if cluster is not None:
            if cluster[0] * cluster[1] * cluster[2] > 8 and not self._nonportable:
                # clusters of more than 8 blocks (Hopper allows 16) must be allowed per kernel
                _check(lib, lib.cuFuncSetAttribute(self.function, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                                   ctypes.c_int(1)), f"{self.name}: cluster size {cluster}")
                self._nonportable = True
            attrs.append((_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, tuple(cluster)))
        array = (_LaunchAttribute * len(attrs))(
            *[_LaunchAttribute(i, 0, (ctypes.c_uint * 16)(*v)) for i, v in attrs]
        )
        config = _LaunchConfig(*grid, block, 1, 1, shared, stream, array, len(attrs))
        _check(lib, lib.cuLaunchKernelEx(ctypes.byref(config), self.function, pointers, None), f"launch {self.name}")


_DRIVER: list = []
_MODULES: dict[tuple, dict[str, CudaKernel]] = {}
_LOCK = threading.Lock()


def _ensure_context(lib, index: int) -> None:
    """Makes the device's primary context current when nothing has yet (a fresh process whose first CUDA call is
    this load: torch creates its context lazily, and selecting the device already selected creates none)."""
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({index})")
    _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def load_kernels(source_name: str, defines: dict[str, int], names: list[str], device: torch.device,
                 arch_suffix: str = "") -> dict:
    """The named `extern "C"` kernels of `cuda/<source_name>` built with `defines`, loaded on `device`.
    arch_suffix "a": the architecture's own features (sm_90a: wgmma), for an image only that device runs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (source_name, tuple(sorted(defines.items())), index, arch_suffix)
    with _LOCK:
        if key in _MODULES:
            return _MODULES[key]
        if not _DRIVER:
            _DRIVER.append(_driver())
        lib = _DRIVER[0]
        major, minor = torch.cuda.get_device_capability(index)
        image = compile_image(SOURCE_DIR / source_name, defines, f"sm_{major}{minor}{arch_suffix}")
        torch.cuda.init()
        with torch.cuda.device(index):  # makes the device's primary context current in this thread
            _ensure_context(lib, index)
            module = ctypes.c_void_p()
            data = ctypes.create_string_buffer(image, len(image) + 1)
            _check(lib, lib.cuModuleLoadData(ctypes.byref(module), data), f"load {source_name} {defines}")
            kernels = {}
            for name in names:
                fn = ctypes.c_void_p()
                _check(lib, lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"find {name}")
                kernels[name] = CudaKernel(name, fn, pdl=pdl_enabled(index))
        _MODULES[key] = kernels
        return kernels
