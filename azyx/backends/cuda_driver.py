"""NVIDIA's driver API and NVRTC as the CUDA backend uses them (cuda-bindings): error checking, which errors leave a
context unusable, driver start-up, and compiling CUDA C to a cubin (cached on disk)."""

from __future__ import annotations

import asyncio
import ctypes
import functools
from pathlib import Path
from typing import Any

from azyx.codegen.templates.gemm_sm90 import TensorMap
from azyx.compiler import artifact_key, cached_build
from azyx.errors import CompileError, DeviceError
from azyx.native import native

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import nvrtc
except ImportError as e:  # the runtime skips this backend (AZYX_DEBUG=1 says why)
    raise ImportError(f"cuda-bindings is not installed (pip install 'azyx[cuda]'): {e}") from None

_INIT: list[bool] = []


class Hot:
    """The driver calls of the launch path (a plan's launches, its event, a graph replay, a copy's DMA), made through
    ctypes with handles as integers: cuda-bindings wraps every result in an enum object, a Python constructor that a
    step of hundreds of launches pays hundreds of times on the loop's thread. Each returns the CUresult as an int
    (0: success; `fail` turns another into the DeviceError `check` would raise).

    On an event loop's thread the calls hold the GIL: each returns at once (copies are from and to pinned memory), and
    released and taken back hundreds of times a step, the GIL would go to another thread at each launch and the loop's
    thread wait for it to come back. Every other thread (the submit thread, workers) takes `releasing`, the same calls
    letting the GIL go: there a call can block, on the driver's own lock while another thread pins host memory
    (cuMemHostAlloc: 3-5 ms per 8 MiB on an H200's host), and holding the GIL through that would stop the loop."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        # the library cuda-bindings has loaded: one driver, one set of contexts
        self.releasing = self if lib is not None else Hot(ctypes.CDLL("libcuda.so.1"))
        lib = lib if lib is not None else ctypes.PyDLL("libcuda.so.1")
        u, p, z = ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t
        self.launch = _fn(lib.cuLaunchKernel, p, u, u, u, u, u, u, u, p, p, p)
        self.event_record = _fn(lib.cuEventRecord, p, p)
        self.event_query = _fn(lib.cuEventQuery, p)
        self.graph_launch = _fn(lib.cuGraphLaunch, p, p)
        self.graph_set_params = _fn(lib.cuGraphExecKernelNodeSetParams, p, p, p)
        self.memset_d32 = _fn(lib.cuMemsetD32Async, ctypes.c_uint64, u, z, p)
        self.htod = _fn(lib.cuMemcpyHtoDAsync_v2, ctypes.c_uint64, p, z, p)
        self.dtoh = _fn(lib.cuMemcpyDtoHAsync_v2, p, ctypes.c_uint64, z, p)
        self._current = _fn(lib.cuCtxGetCurrent, ctypes.POINTER(p))
        # its out-parameter, made once (a PyDLL call holds the GIL: no other thread writes it meanwhile; the releasing
        # set's is never used, `current_context` being asked of the holding one)
        self._ctx = ctypes.c_void_p()
        self._ctx_ref: Any = ctypes.byref(self._ctx)
        # a launch whose kernel parameters are a tuple of 64-bit values (no tensor maps), its table made in C: None
        # where ctypes makes the calls (then `launch` takes the table's address)
        self.launch_values: Any = None
        # (cuLaunchKernel, cuEventRecord, cuEventQuery, cuCtxGetCurrent, cuStreamWriteValue64 or 0) as addresses, for
        # the native queue (CUDADevice.native_queue)
        self.addresses: tuple[int, int, int, int, int] | None = None
        if native is not None and isinstance(lib, ctypes.PyDLL):  # the holding set's calls in C: no ctypes conversions
            def address(f: Any) -> Any:
                return functools.partial(native.call, ctypes.cast(f, ctypes.c_void_p).value)

            self.event_record, self.event_query = address(lib.cuEventRecord), address(lib.cuEventQuery)
            self.graph_launch, self.memset_d32 = address(lib.cuGraphLaunch), address(lib.cuMemsetD32Async)
            self.current_context = functools.partial(  # type: ignore[method-assign]
                native.call_out, ctypes.cast(lib.cuCtxGetCurrent, ctypes.c_void_p).value)
            self.launch_values = functools.partial(native.launch_kernel,
                                                   ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value)
            write = getattr(lib, "cuStreamWriteValue64_v2", None) or getattr(lib, "cuStreamWriteValue64", None)
            self.addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 if f is not None else 0  # type: ignore
                                   for f in (lib.cuLaunchKernel, lib.cuEventRecord, lib.cuEventQuery,
                                             lib.cuCtxGetCurrent, write))

    def here(self) -> Hot:
        """The set for the calling thread: this one on an asyncio loop's thread, else `releasing`."""
        return self if asyncio._get_running_loop() is not None else self.releasing

    def current_context(self) -> int:
        """The calling thread's current context handle (0: none)."""
        self._current(self._ctx_ref)
        return self._ctx.value or 0

    @staticmethod
    def fail(err: int, what: str) -> None:
        check((cu.CUresult(err),), what)


def _fn(f: Any, *argtypes: Any) -> Any:
    f.argtypes, f.restype = list(argtypes), ctypes.c_int
    return f


# errors after which the context is unusable (a kernel faulted): the device fails (Device.fail)
STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
          "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
          "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_CONTEXT_IS_DESTROYED")


def check(result: Any, what: str) -> Any:
    """cuda-bindings returns (error, *values): raise on an error, return the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        if isinstance(err, nvrtc.nvrtcResult):
            name = nvrtc.nvrtcGetErrorString(err)[1].decode()
        else:
            name = cu.cuGetErrorName(err)[1].decode() if cu.cuGetErrorName(err)[0] == 0 else str(err)
        raise DeviceError(f"{what} failed: {name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def sticky(err: BaseException) -> bool:
    """Whether `err` (from `check`) says the context is unusable."""
    return isinstance(err, DeviceError) and any(code in str(err) for code in STICKY)


def describe_pointer(ptr: int) -> str:
    """What the driver knows of an address (for error messages)."""
    attr = cu.CUpointer_attribute
    kind = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    rng = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr)
    start = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr)
    return f"{ptr:#x}: type {kind[1] if kind[0] == 0 else kind[0]}, range {rng[1] if rng[0] == 0 else rng[0]} " \
           f"from {start[1] if start[0] == 0 else start[0]}"


_HOT: list[Hot] = []


def hot() -> Hot:
    """The ctypes calls of the launch path (after `init`: the driver library is there once a device exists)."""
    if not _HOT:
        _HOT.append(Hot())
    return _HOT[0]


def init() -> int:
    """Initialise the driver once; the number of CUDA devices."""
    if not _INIT:
        check(cu.cuInit(0), "cuInit")
        nvrtc_version()
        _INIT.append(True)
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def encode_tensor_map(m: TensorMap, base: int) -> bytes:
    """The 128 bytes of the CUtensorMap `m` describes over the buffer at device address `base` (what the kernel
    takes by value)."""
    kinds = cu.CUtensorMapDataType
    kind = kinds.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if m.dtype == "bfloat16" else kinds.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    encoded = check(cu.cuTensorMapEncodeTiled(
        kind, 2, base + 2 * m.offset, [cu.cuuint64_t(d) for d in m.dims], [cu.cuuint64_t(m.row_bytes)],
        [cu.cuuint32_t(b) for b in m.box], [cu.cuuint32_t(1)] * 2,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), f"cuTensorMapEncodeTiled {m}")
    return ctypes.string_at(encoded.getPtr(), 128)


def versions() -> dict[str, int]:
    """The driver's and NVRTC's versions (what a compiled kernel's speed depends on besides the GPU)."""
    return {"driver": int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion")), "nvrtc": nvrtc_version()}


@functools.cache
def nvrtc_version() -> int:
    """NVRTC's version (major * 1000 + minor * 10). The first call loads NVRTC, holding the GIL for ~9 ms on an H200's
    host: a device's start makes it (`init`), not a service's first compile, whose worker thread would stop the loop
    for that long."""
    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major * 1000 + minor * 10)


# ------------------------------------------------------------------------------------------------ compilation
def nvrtc_compile(src: str, arch: str, name: str = "azyx.cu") -> bytes:
    """CUDA C -> a cubin for `arch` (e.g. "sm_90"), through NVRTC; runs without a GPU. Cached on disk by source,
    architecture and NVRTC version. A failure's CompileError holds NVRTC's log (a device's `builder.failed` adds the
    kernels and the source)."""
    key = artifact_key(src, arch, str(nvrtc_version()))

    def build(out: Path) -> None:
        prog = check(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
            err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
                log = b" " * size
                nvrtc.nvrtcGetProgramLog(prog, log)
                raise CompileError(f"NVRTC failed for {arch}:\n{log.decode(errors='replace')}")
            size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            cubin = b" " * size
            check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        out.write_bytes(cubin)

    return cached_build("cuda", key, ".cubin", build).read_bytes()
