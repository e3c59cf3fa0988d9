"""The C backend: kernels rendered to C99, compiled by the system compiler as an async subprocess, loaded
with ctypes and launched on the device's worker thread.

The kernels a plan runs back to back on the device are one batch: one work item, one call into C (`azyx_run`, in the C
runtime's library), the GIL released for all of it. A batch whose turn has come when it is submitted (all
before it on the device's queue done or queued in C, its waits met) goes to the device's runner, a C thread that runs
queued batches in order with no Python, so it starts even while the submitting thread holds the GIL (building the next
step's graph); a thread that waits in C with the GIL released advances the timeline as they complete (`_Runner`).
Other batches run on the device's worker thread. The thread that runs a batch runs its kernels in
order; a kernel that shares a loop (launch.parallel_kind SHARED: its loop over [lo, hi) of a range) is split into
parts, and the device's pool of helper threads (threads - 1 of them, in C) takes parts too. Each thread starts with its
own run of parts (a static schedule, so that it keeps to its slice of the data) and then takes what others have left.
Nobody waits for a helper that has not taken a part: a helper that sleeps or lost its core means fewer hands, never a
stall, which keeps a busy machine (or PyTorch's OpenMP team beside ours, which makes OpenMP sleep between regions) from
costing a wake-up per kernel. Helpers spin for a while between batches and sleep after that, or at once when they lose
their core; one woken onto the worker's core moves off it (its CPU affinity then excludes that core).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform
import shutil
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from azyx import debug
from azyx.codegen.dialect import C
from azyx.codegen.launch import SHARED
from azyx.codegen.templates import gemm_host
from azyx.compiler import Compiler, compiler_says
from azyx.device import (
    INLINE,
    QUEUED,
    BatchState,
    Buffer,
    Device,
    LaunchItem,
    Replay,
    table_at,
)
from azyx.errors import DeviceError
from azyx.ir import scalar_args
from azyx.native import native
from azyx.plan import KernelStep
from azyx.queues import HostDevice
from azyx.timeline import TimelineSignal

# gcc 12.2 vectorises some pad-guarded loop nests wrongly (whole rows read as zeros) under its znver tuning and
# loop unswitching: generic tuning without unswitching costs nothing measurable (see also codegen.dialect.C).
# An OpenMP loop body loses its pointers' `restrict`, so gcc vectorises it behind run-time overlap checks, 10 pairs
# at most by default: a multi-output kernel (3 stores, 6 loads) needs more, or runs scalar (4x slower)
CONFIG = {"enabled": True, "devices": 1, "compiler": "gcc",
          "flags": ["-O3", "-march=native", "-mtune=generic", "-fno-unswitch-loops", "-fopenmp", "-fno-math-errno",
                    "--param=vect-max-version-for-alias-checks=64"],
          "threads": None, "memory": None, "inline_work": 1 << 16, "gather": True}
AUTO = True

# kernel name -> (address of its `name_argv` entry, its launch.parallel_kind); shared by every C device (one compiler)
_PROGRAMS: dict[str, tuple[int, int]] = {}
_LIBS: list[ctypes.CDLL] = []
_RUNTIME_LIB: list[ctypes.CDLL] = []  # the C runtime's library (`_load_runtime`): azyx_run, the pools, the runner
_RUNTIME_LOCK = threading.Lock()


@functools.cache
def _runtime() -> str:
    """The C runtime's source (c_runtime.c, package data), read at the first compile rather than at import:
    importlib.resources alone takes milliseconds to import."""
    from importlib.resources import files

    return files("azyx.backends").joinpath("c_runtime.c").read_text()


def _compiled(builder: Compiler, src: str, compiler: str, flags: list[str], names: list[str],
              what: str | None = None) -> ctypes.CDLL:
    """`src` built by `compiler` as a shared library under `flags` (killed at the device's compile_timeout_s:
    `Compiler.artifact`), or found in the on-disk cache under the hash of both; loaded."""
    src = "#define _GNU_SOURCE\n" + src  # (the runtime's sched_getcpu)
    cmd = [compiler, *flags, "-shared", "-fPIC", "-std=gnu11", "{src}", "-o", "{out}", "-lm"]
    return ctypes.CDLL(str(builder.artifact("c", src, cmd, (".c", ".so"), names, what=what)))


def _load_runtime(builder: Compiler, compiler: str, flags: list[str]) -> None:
    """The C runtime (c_runtime.c) as a library of its own, built once by the first C device to compile (with its
    compiler and flags; cached on disk like a kernel library) and loaded: a kernel library holds its kernels alone, so
    a compile no longer pays ~0.1 s for the runtime each time (the runtime calls kernels through pointers only)."""
    with _RUNTIME_LOCK:
        if _RUNTIME_LIB:
            return
        lib = _compiled(builder, _runtime(), compiler, flags, [], "the C runtime")
        ptr, long = ctypes.c_void_p, ctypes.c_long
        run = [ptr, long, ptr, ptr, ptr, ctypes.c_char_p, ptr]  # (pool, n, fns, args, argc, kinds, trips)
        for name, args, result in (("azyx_run", run, None), ("azyx_submit", run, None), ("azyx_wait_done", [ptr, long],
                                   long), ("azyx_runner_stop", [ptr], None), ("azyx_pool_new", [ctypes.c_int], ptr),
                                   ("azyx_pool_free", [ptr], None)):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
        _RUNTIME_LIB.append(lib)


def _entries(arity: dict[str, int], kinds: dict[str, int], scalars: dict[str, list[str]]) -> str:
    """`name_argv(lo, hi, args)`: every kernel callable the same way, its buffers and then pointers to its scalar
    arguments as one array (what azyx_run calls); lo and hi bound the shared loop of a SHARED kernel, the others
    ignore them."""
    out = []
    for name, n in arity.items():
        bufs = ", ".join([f"a[{i}]" for i in range(n)] +
                         [f"*({t}*)a[{n + i}]" for i, t in enumerate(scalars[name])])
        call = f"{name}(lo, hi, {bufs})" if kinds[name] == SHARED else f"(void)lo; (void)hi; {name}({bufs})"
        out.append(f"void {name}_argv(long lo, long hi, void** a) {{ {call}; }}")
    return "\n".join(out)


@functools.cache
def _cpu() -> dict[str, str]:
    """The CPU's model name and ISA flags (/proc/cpuinfo's first processor; empty where there is none). Where
    /proc/cpuinfo names no model, the processor Python's `platform` reports (a subprocess on Linux: read last)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        first = ""
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "isa": " ".join(sorted((info.get("flags") or info.get("Features", "")).split()))}


def _cpu_key() -> tuple[str, str]:
    """(-march=native: what the compiler says depends on the CPU too.)"""
    return _cpu()["cpu"], _cpu()["isa"]


def _simd(isa: str, flags: list[str]) -> int:
    """The widest vector registers the compiler may use for the CPU's ISA (bytes): 64 with AVX-512, 32 with AVX2 and
    FMA, else 16 (SSE2, NEON: every 64-bit target); 16 too where the flags do not ask for the CPU's own ISA."""
    have = set(isa.split())
    if not any(f in ("-march=native", "-mcpu=native") for f in flags):
        return 16
    return 64 if "avx512f" in have else 32 if {"avx2", "fma"} <= have else 16


def bf16_dot(isa: str, flags: list[str], compiler: str = "gcc") -> bool:
    """Whether bfloat16 products may use AVX-512 BF16 (`_mm512_dpbf16_ps`): the CPU has it (its ISA flags, as the
    identity records them), the vectors are AVX-512's (`_simd`) and the compiler targets it under the device's flags
    (it predefines __AVX512BF16__: an older compiler or `-mno-avx512bf16` does not). Elsewhere bfloat16 is widened to
    float32 as it is packed."""
    return "avx512_bf16" in isa.split() and _simd(isa, flags) == 64 and "__AVX512BF16__" in _macros(compiler, *flags)


@functools.cache
def _macros(compiler: str, *flags: str) -> frozenset[str]:
    """The macros `compiler` predefines under `flags` (empty where it cannot say)."""
    out = compiler_says("c", compiler, *flags, "-dM", "-E", "-x", "c", os.devnull, key=_cpu_key())
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define ") and " " in line[8:])


@functools.cache
def _compiler_version(compiler: str) -> str:
    out = compiler_says("c", compiler, "--version", key=_cpu_key())
    return out.splitlines()[0] if out else compiler


class CDevice(HostDevice):
    kind = "c"
    dialect = C
    tiles = True
    kills_builds = True
    arena = True

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.compiler = options.get("compiler", "gcc")
        if shutil.which(self.compiler) is None:
            raise DeviceError(f"C compiler {self.compiler!r} not found on PATH")
        self.flags = list(options.get("flags", []))
        self.threads = int(options.get("threads") or os.cpu_count() or 1)
        isa = _cpu()["isa"]  # (its products' micro-kernels)
        self.dialect = dataclasses.replace(C, simd=_simd(isa, self.flags),
                                           bf16_dot=bf16_dot(isa, self.flags, self.compiler))
        self.compute = 30.0 * self.threads  # rough GFLOP/s, for AUTO placement
        self.pool: int | None = None  # the C thread pool that shares kernels' loops (azyx_pool_new)
        self.serial_pool: int | None = None  # a pool of one thread (the caller): small batches run serially
        os.environ.setdefault("OMP_NUM_THREADS", str(self.threads))  # for kernels with a region of their own
        self.programs = _PROGRAMS  # (one compiler: every C device's programs are the same)

    def identity(self) -> dict[str, Any]:
        """The CPU (model and ISA flags), the compiler's version and flags, the threads that share loops, and whether
        bfloat16 products take AVX-512 BF16."""
        return {**super().identity(), **_cpu(), "compiler": _compiler_version(self.compiler), "flags": self.flags,
                "threads": self.threads, "gemm": gemm_host.VERSION, "bf16_dot": self.dialect.bf16_dot}

    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """The library of `src`, each kernel with its `name_argv` entry, compiled by the system compiler (killed at
        compile_timeout_s: `Compiler.artifact`) or found in the on-disk cache, then loaded: per kernel its entry's
        address and parallel kind. The C runtime that calls the entries is a library of its own (`_load_runtime`)."""
        arity = {s.name: len(s.args) for s in steps}
        kinds = {s.name: s.launch.parallel for s in steps}
        scalars = {s.name: [C.compute_type(v.dtype) for v in scalar_args(s.kernel)] for s in steps}
        _load_runtime(self.builder, self.compiler, self.flags)
        lib = _compiled(self.builder, src + "\n" + _entries(arity, kinds, scalars), self.compiler, self.flags,
                        list(arity))
        _LIBS.append(lib)
        return {name: (ctypes.cast(getattr(lib, f"{name}_argv"), ctypes.c_void_p).value or 0, kinds[name])
                for name in arity}

    def prepare_batch(self, batch: BatchState) -> None:
        """INLINE or QUEUED (HostDevice's), and its `_Layout`; the device's thread pools, and its runner, start with
        the first batch that needs them."""
        super().prepare_batch(batch)
        if self.pool is None:
            self.pool = _RUNTIME_LIB[0].azyx_pool_new(self.threads)
            self.queue.native = _Runner(self.pool, self.timeline, self.name)
        # small work, which may run inline on the event loop's thread: by that thread alone, never waiting for a helper
        # that took a part and then lost its core to another process (a stall of a scheduler time slice)
        if batch.how is INLINE and self.serial_pool is None:
            self.serial_pool = _RUNTIME_LIB[0].azyx_pool_new(1)
        batch.prepared = _Layout(batch.steps, self.serial_pool or 0,
                                 self.pool if batch.how is QUEUED else self.serial_pool or 0)

    def freeze(self, replay: Replay) -> bool:
        """A steady batch replays through its `_Layout` (which knows where the run's addresses and words go); not
        under AZYX_DEBUG's launch timings (each kernel its own call)."""
        if debug.enabled(debug.LAUNCHES):
            return False
        assert type(replay.batch.prepared) is _Layout
        replay.prepared = replay.batch.prepared
        return True

    def launch_replay(self, replay: Replay, bufs: list[Any], arena: Buffer | None, scalars: Sequence[Any],
                      waits: list[tuple[Device, int]]) -> int:
        """As `launch_many` (`run_batch`): here and now through the table, or one work item (one `_Batch`)."""
        layout, how = replay.prepared, replay.batch.how
        addresses = replay.addresses(bufs, arena)
        words = replay.words(scalars) if layout.n_words else None
        return self.run_batch(how, waits, layout.frozen_inline, (addresses, words),
                              functools.partial(layout.frozen_batch, addresses, words, (arena, replay.get(bufs))))

    def batch_fn(self, items: list[LaunchItem], batch: BatchState) -> Callable[[], None]:
        layout = batch.prepared
        assert type(layout) is _Layout and self.pool is not None
        if debug.enabled(debug.LAUNCHES):  # one call per kernel, each timed
            return self.timed([_Layout([item[0]], 0, self.pool).batch([item]) for item in items], items)
        return layout.batch(items)

    def close(self) -> None:
        worker = self.queue.thread
        super().close()
        runner = self.queue.native
        if isinstance(runner, _Runner):
            runner.close()  # after the worker: it may wait for a batch in the runner's queue
            self.queue.native = None
        if worker is None or not worker.is_alive():  # nothing runs on the pools any more
            for pool in (self.pool, self.serial_pool):
                if pool is not None:
                    _RUNTIME_LIB[0].azyx_pool_free(pool)
            self.pool = self.serial_pool = None


class _Layout:
    """What a batch's call into C needs that depends on its kernels alone (entry points, kinds, trip counts, how many
    buffers each takes, where its table holds what: `device.table_at`): made once per plan's batch, so a run only
    fills in the buffers' addresses and words: from launch items into the scratch table where it runs inline
    (`inline`), else with numpy (a frozen batch's runs, device.Replay: `frozen_inline`; every queued run, frozen or
    of launch items: `frozen_batch`)."""

    __slots__ = ("n", "fns", "argc", "kinds", "trips", "buf_at", "pointer_at", "last", "scratch", "value_ptrs",
                 "fill", "kinds_table", "call", "serial", "pool", "n_words", "pointer_rel", "inline_table")

    def __init__(self, steps: list[KernelStep], serial: int, pool: int):
        self.n = len(steps)
        self.serial = serial  # the pool of one thread that an INLINE batch runs on (`inline`)
        self.pool = pool  # the pool its queued runs take (`_Batch`): the device's, or the serial one for small work
        entries = [_PROGRAMS[step.name] for step in steps]
        self.fns = (ctypes.c_void_p * self.n)(*[address for address, _ in entries])
        self.argc = (ctypes.c_long * self.n)(*[len(step.args) + len(step.scalars) for step in steps])
        self.kinds = bytes([kind for _, kind in entries])
        self.trips = (ctypes.c_long * self.n)(*[step.launch.trip for step in steps])
        # per kernel its buffers' addresses and then pointers to its scalar arguments (at `pointer_at`, where the
        # device table holds the words); the scalars' values end the table
        self.buf_at, self.pointer_at, _ = table_at(steps)
        self.n_words = n_words = len(self.pointer_at)
        self.last: tuple[Any, Any] = (None, None)  # what the last queued run's table was made of, and its work item
        # the table of a batch that runs where it is submitted (`inline`): one per layout, rewritten by each such run
        # (runs of a device's queue never overlap), its value pointers fixed once
        self.scratch = (ctypes.c_void_p * (sum(self.argc) + n_words))()
        base = ctypes.addressof(self.scratch) + 8 * (len(self.scratch) - n_words)
        values = iter(range(base, base + 8 * n_words, 8))
        self.value_ptrs = [[next(values) for _ in step.scalars] for step in steps]  # per kernel: its values' places
        self.fill = struct.Struct(f"<{len(self.scratch)}Q").pack_into
        # the call itself in C where azyx's native core is built: no ctypes conversions, and the GIL stays held (the
        # work is small), where ctypes would let it go and take it back
        self.kinds_table = (ctypes.c_ubyte * self.n)(*self.kinds)
        self.call = native.TableCall(
            ctypes.cast(_RUNTIME_LIB[0].azyx_run, ctypes.c_void_p).value, self.n, ctypes.addressof(self.fns),
            ctypes.addressof(self.scratch), len(self.scratch), ctypes.addressof(self.argc),
            ctypes.addressof(self.kinds_table), ctypes.addressof(self.trips)) if native is not None else None
        # a frozen batch's tables: its values' offsets in a table of its own (`frozen_batch`), and the scratch's
        # (`frozen_inline`, TableCall's) with its value pointers fixed
        self.pointer_rel = np.arange(len(self.scratch) - n_words, len(self.scratch), dtype=np.uint64) * np.uint64(8)
        self.inline_table = np.zeros(len(self.scratch), np.uint64)
        self.inline_table[self.pointer_at] = [p for at in self.value_ptrs for p in at]

    def batch(self, items: list[LaunchItem]) -> _Batch:
        """The work item of a queued run of launch items, through a table of its own as a frozen batch's run has
        (`frozen_batch`). A steady plan gets the same blocks from the pool and passes the same values: the last run's
        table serves again (C only reads it)."""
        ptrs = [b.ptr for _, bufs, _ in items for b in bufs]
        words = [w for _, _, ws in items for w in ws]
        if self.last[0] != (ptrs, words):
            self.last = ((ptrs, words), self.frozen_batch(np.array(ptrs, np.uint64),
                                                          np.array(words, np.uint64) if words else None, None))
        made = self.last[1]
        return _Batch(self, made.ptrs, (items, made.keep))

    def inline(self, items: list[LaunchItem]) -> None:
        """Run the batch now, on the calling thread (its serial pool), through the scratch table: its buffers'
        addresses and its values' places kernel after kernel (`_arguments`), or its buffers' addresses alone."""
        self.run_scratch(_arguments(items, self.value_ptrs) if self.n_words else
                         [b.ptr for _, bufs, _ in items for b in bufs])

    def run_scratch(self, vals: list[int]) -> None:
        """Run the batch now, on the calling thread (its serial pool), with `vals` as its scratch table."""
        if self.call is not None:
            self.call(self.serial, vals)
            return
        self.fill(self.scratch, 0, *vals)
        _RUNTIME_LIB[0].azyx_run(self.serial, self.n, self.fns, self.scratch, self.argc, self.kinds, self.trips)

    def frozen_inline(self, addresses: np.ndarray, words: np.ndarray | None) -> None:
        """Run a frozen batch now, on the calling thread (its serial pool), with a run's addresses and words."""
        table = self.inline_table.copy()
        table[self.buf_at] = addresses
        if words is not None:
            table[len(table) - self.n_words:] = words
        self.run_scratch(table.tolist())

    def frozen_batch(self, addresses: np.ndarray, words: np.ndarray | None, keep: Any) -> _Batch:
        """The work item of a queued run (a frozen batch's, or launch items': `batch`): a table of its own (it lives
        until the batch has run, with `keep`: the buffers)."""
        table = np.empty(len(self.inline_table), np.uint64)
        table[self.buf_at] = addresses
        address = table.ctypes.data
        if words is not None:
            table[self.pointer_at] = self.pointer_rel + np.uint64(address)
            table[len(table) - self.n_words:] = words
        return _Batch(self, address, (keep, table))


def _arguments(items: list[LaunchItem], at: list[list[int]]) -> list[int]:
    """A batch's table of arguments: per kernel its buffers' addresses and then the pointers to its scalars' values
    (`at`, per kernel), then every scalar's value."""
    vals: list[int] = []
    words: list[int] = []
    for i, (_, bufs, ws) in enumerate(items):
        vals += [b.ptr for b in bufs]
        vals += at[i]
        words += ws
    return vals + words


class _Batch:
    """Kernels run back to back by one call into C through `ptrs`, the address of their table of arguments
    (`_Layout.frozen_batch`) on its layout's pool; holds `keep` (their buffers, the table's memory) until it has run
    (then the pool may reuse them)."""

    __slots__ = ("layout", "ptrs", "keep")

    def __init__(self, layout: _Layout, ptrs: Any, keep: Any):
        self.layout, self.ptrs, self.keep = layout, ptrs, keep

    def __call__(self) -> None:
        lay = self.layout
        _RUNTIME_LIB[0].azyx_run(lay.pool, lay.n, lay.fns, self.ptrs, lay.argc, lay.kinds, lay.trips)


class _Runner:
    """The device's C runner seen from Python (a WorkQueue's native queue): `put` hands a batch to it (azyx_submit
    only queues it, so it starts with no Python thread and no GIL), and a completion thread that waits in C with the
    GIL released drops each batch, so its buffers, once it has run, then advances the timeline."""

    def __init__(self, pool: int, timeline: TimelineSignal, name: str):
        self.pool, self.timeline, self.name = pool, timeline, name
        self.held: deque[tuple[int, _Batch]] = deque()  # (timeline value, batch) handed over, in order
        self.thread: threading.Thread | None = None

    def takes(self, fn: Callable[[], None]) -> bool:
        return type(fn) is _Batch

    def put(self, fn: Callable[[], None], v: int) -> None:
        assert isinstance(fn, _Batch)
        self.held.append((v, fn))  # before the runner can count it
        if self.thread is None:
            self.thread = threading.Thread(target=self._complete, name=f"azyx-{self.name}-done", daemon=True)
            self.thread.start()
        lay = fn.layout
        _RUNTIME_LIB[0].azyx_submit(self.pool, lay.n, lay.fns, fn.ptrs, lay.argc, lay.kinds, lay.trips)

    def _complete(self) -> None:
        seen, wait_done = 0, _RUNTIME_LIB[0].azyx_wait_done
        while (done := wait_done(self.pool, seen)) >= 0:
            v = 0
            for _ in range(done - seen):
                v = self.held.popleft()[0]  # the batch goes, and its buffers back to the pool, before the signal
            seen = done
            self.timeline.signal(v)

    def close(self) -> None:
        """Let the runner run what it was given, then stop it and the completion thread."""
        _RUNTIME_LIB[0].azyx_runner_stop(self.pool)
        if self.thread is not None:
            self.thread.join()
            self.thread = None
