"""The C backend: kernels rendered to C99, compiled by the system compiler as an async subprocess, loaded
with ctypes and launched on the device's worker thread (OpenMP parallelises inside a kernel)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from azyx import debug
from azyx.backends.host import HostDevice
from azyx.config import cache_dir
from azyx.cstyle import C, kernel_source
from azyx.device import Buffer
from azyx.errors import CompileError, DeviceError
from azyx.plan import KernelStep
from azyx.workers import in_worker_thread

_PROGRAMS: dict[str, Any] = {}  # kernel name -> ctypes function; shared by every C device (same compiler)
_LIBS: list[ctypes.CDLL] = []


class CDevice(HostDevice):
    kind = "c"
    dialect = C
    tiles = True

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.compiler = options.get("compiler", "gcc")
        if shutil.which(self.compiler) is None:
            raise DeviceError(f"C compiler {self.compiler!r} not found on PATH")
        self.flags = list(options.get("flags", []))
        self.threads = int(options.get("threads") or os.cpu_count() or 1)
        self.compute = 30.0 * self.threads  # rough GFLOP/s, for AUTO placement
        os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))

    def has_program(self, name: str) -> bool:
        return name in _PROGRAMS

    async def compile(self, steps: list[KernelStep]) -> None:
        todo = {s.name: len(s.args) for s in steps if s.name not in _PROGRAMS}
        if not todo:
            return
        src = kernel_source([s.src for s in {s.name: s for s in steps if s.name in todo}.values()], C)  # once each
        debug.log(debug.SOURCE, lambda: f"C source for {', '.join(todo)}:\n{src}")
        # build (or find in the disk cache) and load on a worker thread: the loop only waits; a cancelled realize
        # stops waiting while the build still finishes into the cache
        _PROGRAMS.update(await in_worker_thread(self._build_and_load, src, todo))

    def _build_and_load(self, src: str, arity: dict[str, int]) -> dict[str, Any]:
        flags = [*self.flags, "-shared", "-fPIC", "-std=gnu11"]
        key = hashlib.sha256((src + "\0" + self.compiler + " ".join(flags)).encode()).hexdigest()[:24]
        lib_path = cache_dir() / "c" / f"{key}.so"
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            stem = lib_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
            c_path, tmp_lib = stem.with_suffix(stem.suffix + ".c"), stem.with_suffix(stem.suffix + ".tmp")
            try:
                c_path.write_text(src)
                cmd = [self.compiler, *flags, str(c_path), "-o", str(tmp_lib), "-lm"]
                result = subprocess.run(cmd, capture_output=True, check=False)
                if result.returncode != 0:
                    raise CompileError(f"{self.compiler} failed (exit {result.returncode}):\n"
                                       f"{result.stderr.decode(errors='replace')}\n--- source ---\n{src}")
                os.replace(tmp_lib, lib_path)  # atomic: a concurrent reader never sees half a library
            finally:
                c_path.unlink(missing_ok=True)
                tmp_lib.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(lib_path))
        _LIBS.append(lib)
        programs = {}
        for name, n in arity.items():
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p] * n  # one pointer per buffer
            fn.restype = None
            programs[name] = fn
        return programs

    def launch_fn(self, step: KernelStep, bufs: list[Buffer]) -> Callable[[], None]:
        fn = _PROGRAMS[step.name]
        ptrs = [b.ptr for b in bufs]
        if debug.enabled(debug.LAUNCHES):
            import time

            def timed(bufs: list[Buffer] = bufs) -> None:
                t0 = time.perf_counter()
                fn(*ptrs)
                debug.log(debug.LAUNCHES, f"{self.name}: {step.name} work={step.work} "
                                          f"{(time.perf_counter() - t0) * 1e6:.1f} us")
            return timed
        return _Launch(fn, ptrs, bufs)


class _Launch:
    """One kernel launch; holds its buffers until it has run (then the pool may reuse them)."""

    __slots__ = ("fn", "ptrs", "bufs")

    def __init__(self, fn: Any, ptrs: list[int], bufs: list[Buffer]):
        self.fn, self.ptrs, self.bufs = fn, ptrs, bufs

    def __call__(self) -> None:
        self.fn(*self.ptrs)
