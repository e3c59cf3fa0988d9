"""The WebGPU backend on wgpu-py (wgpu-native): every adapter wgpu reports on a real driver (Vulkan, Metal, D3D12; its
OpenGL fallback only where configured) is a `wgpu:N` device. Kernels are WGSL compute shaders from azyx's own WGSL
renderer (codegen/wgsl.py), one pipeline each with an explicit layout: its buffers as storage bindings, its scalars in a
uniform window of the device's words buffer (written by `queue.write_buffer` before each submission, so a new value
compiles nothing).

Queue and completion: one submit thread per device (QueuedDevice's) owns every submission (submit, write_buffer, map).
A driver may block a second `queue.submit` or a `map_async` while earlier work runs (lavapipe does), so none of them
happen on the event loop: the loop only numbers a work item (its TimelineSignal value) and hands it to that thread. It
waits for the item's waits on other devices (their timelines), encodes and submits it. A completion thread advances the
timeline to the newest item submitted once the queue says its work is done (`queue.on_submitted_work_done_sync`, which
wgpu-py resolves from its own poller thread: no spinning); a read advances it itself once its staging buffer is mapped
(which implies everything before it: the queue is in order).

Memory: pooled storage buffers (sizes in multiples of 4 bytes: WebGPU copies and writes move 4-byte words); reads
back copy into a pooled MAP_READ staging buffer and map it; writes are `queue.write_buffer` up to UPLOAD_DIRECT bytes,
larger ones fill a pooled MAP_WRITE buffer and copy from it (2.4 GB/s against write_buffer's 0.7-1.0 for 64 MiB on
lavapipe: write_buffer stages through a fresh allocation of the driver's each time). Each pool holds the buffers it
makes until it lets them go (`memory.OwnedPool`): one given back by the cyclic GC is never one wgpu-py released.
Limits come from the adapter: storage bindings per stage (`max_buffers`, which the scheduler respects), the storage
binding size (a kernel binds a larger buffer as several ranges, `wgsl.bindings`), the buffer size (a larger one is
refused with an AllocationError naming both), workgroups per dimension (the renderer folds long grids into a 2-D
dispatch).
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from azyx import debug
from azyx.codegen import search_actions as optimize
from azyx.codegen.dialect import WGSL as WGSL_FACTS
from azyx.codegen.dialect import WGSL_TYPES
from azyx.codegen.launch import Launch
from azyx.codegen.wgsl import bindings, render_wgsl
from azyx.config import ConfigError
from azyx.device import Buffer, Device, LaunchItem, word_table
from azyx.errors import DeviceError
from azyx.ir import Kernel, scalar_args
from azyx.memory import OwnedPool, memory_bytes
from azyx.plan import KernelStep
from azyx.queues import QueuedDevice
from azyx.workers import at_lower_priority

# backends: wgpu's backend types to use (default: the real drivers, Vulkan, Metal, D3D12; name "OpenGL" to allow
# its fallback); power_preference orders adapters: "high-performance" (discrete first) or "low-power"; features:
# the adapter features kernels may use (None: every one azyx knows that the adapter has: shader-f64, shader-int64)
CONFIG = {"enabled": True, "backends": [], "power_preference": "high-performance", "features": None, "memory": None}

try:
    import wgpu
except ImportError as e:  # the runtime skips this backend (AZYX_DEBUG=1 says why)
    raise ImportError(f"the wgpu package (wgpu-py) is not installed: {e}") from None

# adapter features a kernel may use, requested where the adapter has them (the dtype table says which needs which)
FEATURES = frozenset(t.feature for t in WGSL_TYPES.values() if t.feature)
REAL_BACKENDS = ("Vulkan", "Metal", "D3D12")  # wgpu's OpenGL backend is a fallback: only where configured
ADAPTER_ORDER = {"high-performance": ("DiscreteGPU", "IntegratedGPU", "VirtualGPU", "CPU", "Unknown"),
                 "low-power": ("IntegratedGPU", "DiscreteGPU", "VirtualGPU", "CPU", "Unknown")}
# drivers that end a shader's loops after so many iterations in all (Mesa's llvmpipe: LP_MAX_TGSI_LOOP_ITERATIONS),
# by a substring of the adapter's device name: the renderer unrolls reduce loops to stay below it (wgsl.unroll)
LOOP_LIMITS = {"llvmpipe": 65535}
BIND_GROUPS = 4096  # bind groups a device keeps (by kernel, buffers and words window)
STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
STAGING = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
UPLOAD = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
UPLOAD_DIRECT = 1 << 20  # host writes up to this size go by queue.write_buffer, larger ones through upload buffers
WORDS = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST


def _ceil4(n: int) -> int:
    return -(-n // 4) * 4


@functools.cache
def _all_adapters() -> tuple[Any, ...]:
    """Every adapter wgpu finds (once per process: enumerating starts every backend's driver)."""
    return tuple(at_lower_priority(wgpu.gpu.enumerate_adapters_sync))  # (the driver's threads run below the loop)


def adapters(options: dict[str, Any]) -> list[Any]:
    """The configured adapters in preference order: those of the `backends` named (default: the real drivers, never
    the OpenGL fallback), ordered by `power_preference` ("high-performance": discrete GPUs first; "low-power":
    integrated first), the order wgpu reports them in within a type."""
    backends = options.get("backends") or list(REAL_BACKENDS)
    unknown = [b for b in backends if b not in (*REAL_BACKENDS, "OpenGL")]
    if unknown:
        raise ConfigError(f"wgpu: backends {unknown} unknown (wgpu's are {[*REAL_BACKENDS, 'OpenGL']})")
    pref = options.get("power_preference", "high-performance")
    if pref not in ADAPTER_ORDER:
        raise ConfigError(f"wgpu: power_preference must be one of {sorted(ADAPTER_ORDER)}, got {pref!r}")
    order = ADAPTER_ORDER[pref]
    found = [a for a in _all_adapters() if a.info["backend_type"] in backends]
    for a in _all_adapters():
        if a not in found:
            debug.log(debug.DEVICES, f"wgpu: adapter {a.info['device']} ({a.info['backend_type']}) not used: "
                                     f"backends {backends} (config section 'wgpu')")
    return sorted(found, key=lambda a: order.index(a.info["adapter_type"]) if a.info["adapter_type"] in order
                  else len(order))


class _Program:
    """A kernel's pipeline and bind group layout, and how it binds: per buffer its ranges (`wgsl.bindings`: how many,
    the bytes of each), and the bytes of its scalars' uniform window (0: none)."""

    __slots__ = ("pipeline", "layout", "ranges", "words")

    def __init__(self, pipeline: Any, layout: Any, ranges: list[tuple[int, int]], words: int):
        self.pipeline, self.layout, self.ranges, self.words = pipeline, layout, ranges, words

    def entries(self, bufs: list[Buffer]) -> list[dict[str, Any]]:
        """The bind group entries of the buffers (their ranges in order), without the words."""
        out: list[dict[str, Any]] = []
        for b, (n, size) in zip(bufs, self.ranges):
            mem = b.mem
            for c in range(n):
                at = c * size
                if at >= mem.size:  # a range the kernel's index bound reaches but never its valid indices
                    at = 0
                out.append({"binding": len(out), "resource": {"buffer": mem, "offset": at,
                                                               "size": min(size, mem.size - at)}})
        return out


class WgpuDevice(QueuedDevice):
    """WebGPU has no events: the submit thread runs each item once its waits are reached (a callable that submits
    commands and says whether their completion is known on return, or None: nothing but waiting), and the event
    queue's waiter thread waits for the work submitted so far (`wait_event`)."""

    kind = "wgpu"
    dialect = WGSL_FACTS  # launch facts only: `render` is the WGSL renderer's
    shaders = True

    @classmethod
    def count(cls, options: dict[str, Any]) -> int:
        return len(adapters(options))

    def __init__(self, index: int, options: dict[str, Any]):
        super().__init__(index, options)
        self.adapter = adapters(options)[index]  # (index < `count`: the registry's)
        info = self.adapter.info
        self.label = f"{info['device']} ({info['backend_type']})"
        wanted_features = FEATURES if options.get("features") is None else frozenset(options["features"])
        if wanted_features - FEATURES:
            raise ConfigError(f"wgpu: features {sorted(wanted_features - FEATURES)} unknown (azyx uses "
                              f"{sorted(FEATURES)})")
        self.features = frozenset(self.adapter.features) & FEATURES & wanted_features
        limits = self.adapter.limits
        wanted = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
                  "max-compute-workgroups-per-dimension")
        try:
            self.gpu = at_lower_priority(functools.partial(
                self.adapter.request_device_sync, required_features=sorted(self.features),
                required_limits={k: limits[k] for k in wanted}))
        except Exception as e:
            raise DeviceError(f"{self.name}: requesting a device of {self.label} failed: {e}") from None
        self.gpu_queue = self.gpu.queue
        self.max_binding = int(limits["max-storage-buffer-binding-size"])  # (larger buffers bind as several ranges)
        self.mem.max_block, self.mem.max_block_name = int(limits["max-buffer-size"]), "max-buffer-size"
        self.max_trips = next((n for name, n in LOOP_LIMITS.items() if name in info["device"]), 0)
        self.max_buffers = int(limits["max-storage-buffers-per-shader-stage"])
        self.word_align = int(limits["min-uniform-buffer-offset-alignment"])
        if limits["max-compute-workgroups-per-dimension"] < WGSL_FACTS.max_groups:
            raise DeviceError(f"{self.name}: {self.label} allows only "
                              f"{limits['max-compute-workgroups-per-dimension']} workgroups per dimension")
        self.runs_on(info["adapter_type"])
        # (WebGPU does not tell a device's memory: config section 'wgpu', "memory", says it); blocks are kept for reuse
        # up to the capacity: a kept bind group names its buffers (`_bind_group`)
        default = {"CPU": memory_bytes() // 4, "DiscreteGPU": 16 << 30}.get(info["adapter_type"], 4 << 30)
        self.mem.open_pool(options, default, functools.partial(self._buffer, STORAGE), pool=OwnedPool)
        self.groups: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
        self.staging, self.uploads = (self.mem.staging(functools.partial(self._buffer, usage), what, 256 << 20,
                                                       pool=OwnedPool) for usage, what in ((STAGING, "staging"),
                                                                                            (UPLOAD, "uploads")))
        self.mem.destroy = operator.methodcaller("destroy")
        self.words = self.gpu.create_buffer(size=1 << 16, usage=WORDS)  # the scalars of a submission (worker only)
        self.last_words = b""  # what the words buffer holds from its start, once the queue's writes are done
        self.done = 0  # the last value known complete (`wait_event`: one wait covers all submitted before it)
        self._warm_up()
        self.queue.start()
        debug.log(debug.DEVICES, f"{self.name}: {self.label} ({info['adapter_type']}, wgpu {wgpu.__version__}; "
                                 f"features {', '.join(sorted(self.features)) or 'none'}; storage bindings up to "
                                 f"{self.max_binding >> 20} MiB, {self.max_buffers} per kernel)")

    def _warm_up(self) -> None:
        """Make every wgpu-py call the device makes once, at its start, through its own paths (a kernel with a storage
        buffer and scalars run, read back, then written through an upload buffer): wgpu-py's cffi parses each C type
        the first time it meets it, in Python (pycparser, ~1 ms a type), and the first requests of a process held the
        event loop's thread off the GIL for 25-230 ms while the queue's threads parsed (two busy processes beside
        them)."""
        src = ("@group(0) @binding(0) var<storage, read_write> o: array<u32>;\n"
               "@group(0) @binding(1) var<uniform> w: vec4<u32>;\n"
               "@compute @workgroup_size(1) fn warm() { o[0] = w.x; }\n")
        prog = _Program(*self._pipeline(src, "warm", ["storage", "uniform"]), [(1, 16)], 16)
        out, got = self.alloc(16), np.zeros(16, np.uint8)
        self._write_words(np.arange(7, 11, dtype=np.uint32).tobytes())
        self._dispatch([(prog.pipeline, self._bind_group("warm", prog, [out], 0), (1, 1, 1))])
        self._read_back(out, 0, 16, got, 0)
        self._upload(got, out.mem, 0)
        self.gpu_queue.submit([])
        self.gpu_queue.on_submitted_work_done_sync()
        self.groups.clear()
        if got.view(np.uint32)[0] != 7:
            raise DeviceError(f"{self.name}: a first kernel on {self.label} wrote {got.view(np.uint32)[0]}, not 7")

    # ------------------------------------------------------------------ memory
    def _buffer(self, usage: int, size: int) -> Any:
        return self.gpu.create_buffer(size=_ceil4(max(size, 4)), usage=usage)

    # ------------------------------------------------------------------ compile
    # (WGSL: no register tiles; vectors in elementwise kernels, wgsl.WGSL_VEC)
    search_actions = frozenset({optimize.LOCAL, optimize.GROUP, optimize.UNROLL, optimize.VECTOR})

    def identity(self) -> dict[str, Any]:
        info = self.adapter.info
        return {**super().identity(), "wgpu": wgpu.__version__, "features": sorted(self.features),
                **{k: str(info.get(k, "")) for k in ("vendor", "device", "backend_type", "adapter_type",
                                                     "description")}}

    def render_ir(self, k: Kernel) -> tuple[str, str, Launch]:
        return render_wgsl(k, self.name, self.features, self.max_binding, self.max_trips)

    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """Per kernel a shader module (wgpu's naga compiles and validates the WGSL) and a compute pipeline with the
        layout of the renderer's interface. (No artifact to keep on disk: the driver compiles the pipeline.)"""
        return self.builder.each(steps, lambda step, _: self._program(step), "building")

    def _program(self, step: KernelStep) -> _Program:
        """A kernel's pipeline, bound as its renderer's interface says (`wgsl.bindings`, its scalars' words)."""
        k = step.kernel
        words = 16 * (-(-len(scalar_args(k)) // 2))
        ranges = bindings(k, self.max_binding)
        types = ["storage" if k.writes(i) else "read-only-storage" for i, (n, _) in enumerate(ranges) for _ in range(n)]
        pipeline, layout = self._pipeline(step.src, step.name, types + ["uniform"] * bool(words))
        return _Program(pipeline, layout, ranges, words)

    def _pipeline(self, code: str, entry: str, types: list[str]) -> tuple[Any, Any]:
        """A compute pipeline of WGSL `code`'s function `entry` and its bind group layout: bindings 0.. of `types`."""
        layout = self.gpu.create_bind_group_layout(entries=[
            {"binding": b, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": t}} for b, t in enumerate(types)])
        return self.gpu.create_compute_pipeline(
            layout=self.gpu.create_pipeline_layout(bind_group_layouts=[layout]),
            compute={"module": self.gpu.create_shader_module(code=code), "entry_point": entry}), layout

    # ------------------------------------------------------------------ the queue
    def submit(self, run: Callable[[], bool] | None, waits: list[tuple[Device, int]], v: int) -> bool:
        """(The submit thread.) The item run after its waits (WebGPU has no events: all are the host's to see,
        `host_waited`); True: its own work says it is complete."""
        return self.queue.host_waited(waits, v)[1] and run is not None and run()

    def wait_event(self, known: bool, v: int) -> bool:
        """Item `v` is complete where its own work said so (a read, mapped), else once the queue's work submitted so
        far is (wgpu-py resolves that from its poller thread): one wait covers every item before."""
        if known or v <= self.done:
            return True
        upto = self.queue.through
        self.gpu_queue.on_submitted_work_done_sync()  # (an error: recorded by the waiter thread)
        self.done = upto
        return True

    def _submit(self, encode: Callable[[Any], None]) -> bool:
        """(Worker thread.) One command buffer, submitted; False: its completion is the queue's to tell."""
        enc = self.gpu.create_command_encoder()
        encode(enc)
        self.gpu_queue.submit([enc.finish()])
        return False

    def _copy(self, src: Any, src_at: int, dst: Any, dst_at: int, n: int) -> bool:
        """(Worker thread.) A copy of `n` bytes (a multiple of 4) between wgpu buffers, where there is one."""
        return bool(n) and self._submit(lambda enc: enc.copy_buffer_to_buffer(src, src_at, dst, dst_at, n))

    # ------------------------------------------------------------------ launches
    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]], batch: Any = None) -> int:
        """The kernels in one compute pass, one submission (WebGPU orders each dispatch's writes before the next
        dispatch's reads)."""
        return self.queue.enqueue(lambda: self._run_kernels(items), waits, items)

    def _run_kernels(self, items: list[LaunchItem]) -> bool:
        """(Worker thread.) Write the kernels' scalars into the words buffer, bind, dispatch, submit."""
        progs = [self.programs[step.name] for step, _, _ in items]
        offsets, table = word_table([list(w) for _, _, w in items], [p.words for p in progs], self.word_align)
        if table.nbytes:
            self._write_words(table.tobytes())
        assert not any(step.launch.zero for step, _, _ in items), "WGSL kernels zero nothing first"
        return self._dispatch([(prog.pipeline, self._bind_group(step.name, prog, bufs, off), step.launch.grid)
                               for (step, bufs, _), prog, off in zip(items, progs, offsets)])

    def _write_words(self, data: bytes) -> None:
        """(Worker thread.) A submission's scalars into the words buffer (a larger one where it is too small), where
        it does not hold them already (a write is in queue order: the same words need none)."""
        if self.words.size < len(data):
            self.words = self.gpu.create_buffer(size=max(len(data), 2 * self.words.size), usage=WORDS)
            self.last_words = b""
        if not self.last_words.startswith(data):
            self.gpu_queue.write_buffer(self.words, 0, data)
            self.last_words = data

    def _dispatch(self, launches: list[tuple[Any, Any, tuple[int, ...]]]) -> bool:
        """(Worker thread.) The launches (pipeline, bind group, grid) in one compute pass, one submission (WebGPU
        orders each dispatch's writes before the next dispatch's reads)."""

        def encode(enc: Any) -> None:
            cpass = enc.begin_compute_pass()
            for pipeline, group, grid in launches:
                cpass.set_pipeline(pipeline)
                cpass.set_bind_group(0, group)
                cpass.dispatch_workgroups(*grid)
            cpass.end()

        return self._submit(encode)

    def _bind_group(self, name: str, prog: _Program, bufs: list[Buffer], off: int) -> Any:
        """(Worker thread.) The bind group of a kernel's buffers and words window: made once per combination and kept
        (the last BIND_GROUPS used; making one costs more than the rest of a launch: ~60 us on lavapipe). The entry
        holds the buffers it names, so that their identities in its key stay theirs (the pool keeps its blocks for
        reuse anyway: its cache limit is the capacity)."""
        key = (name, off, id(self.words), *(id(b.mem) for b in bufs))
        kept = self.groups.get(key)
        if kept is not None:
            self.groups.move_to_end(key)
            return kept[0]
        entries = prog.entries(bufs)
        if prog.words:
            entries.append({"binding": len(entries), "resource": {"buffer": self.words, "offset": off,
                                                                  "size": prog.words}})
        group = self.gpu.create_bind_group(layout=prog.layout, entries=entries)
        self.groups[key] = (group, self.words, [b.mem for b in bufs])
        if len(self.groups) > BIND_GROUPS:
            self.groups.popitem(last=False)
        return group

    # ------------------------------------------------------------------ copies
    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self.queue.enqueue(lambda: self._copy(src.mem, 0, dst.mem, 0, _ceil4(n)), waits, (src, dst))

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """In queue order: a copy into a staging buffer, mapped once it is done (which says all before it is)."""
        flat = out.reshape(-1).view(np.uint8)
        n = flat.nbytes

        def run() -> bool:
            lo = offset & ~3
            self._read_back(buf, lo, _ceil4(offset + n) - lo, flat, offset - lo)
            return True

        return self.queue.enqueue(run, waits, (buf, out))

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        """Once `waits` are reached: `queue.write_buffer` (flushed by an empty submission), or for more than
        UPLOAD_DIRECT bytes a pooled upload buffer mapped for writing (a map waits until the queue's earlier copies
        from it are done) and a copy command. Copies move whole 4-byte words: an unaligned piece is padded with the
        bytes around it (`_padded`)."""
        src = host.reshape(-1).view(np.uint8)

        def run() -> bool:
            if not src.nbytes:
                return False
            data = src if src.nbytes % 4 == 0 and offset % 4 == 0 else self._padded(src, dst, offset)
            size = data.nbytes
            if size <= UPLOAD_DIRECT:
                self.gpu_queue.write_buffer(dst.mem, offset & ~3, data)
                self.gpu_queue.submit([])
                return False
            return self._upload(data, dst.mem, offset & ~3)

        return self.queue.enqueue(run, waits, (keep, dst))

    def _upload(self, data: np.ndarray, dst: Any, at: int) -> bool:
        """(Worker thread.) `data` (whole words) into wgpu buffer `dst` from byte `at`: through a pooled upload buffer
        mapped for writing (a map waits until the queue's earlier copies from it are done), then a copy command."""
        size = data.nbytes
        up = self.uploads.lend(size)  # (back to the pool at once, in use until the copy is done: its next map waits)
        up.block.map_sync("WRITE", 0, size)
        try:  # (numpy's copy lets go of the GIL; write_mapped's held it through page faults, the loop asleep)
            np.copyto(np.frombuffer(up.block._experimental_get_mapped_range(0, size), np.uint8), data)
        finally:
            up.block.unmap()
        return self._copy(up.block, 0, dst, at, size)

    def _padded(self, src: np.ndarray, dst: Buffer, offset: int) -> np.ndarray:
        """(Worker thread, rare: an unaligned write.) The words `src` lands in at `offset`, the bytes around it read
        back from `dst` first."""
        lo = offset & ~3
        words = np.empty(_ceil4(offset + src.nbytes) - lo, np.uint8)
        self._read_back(dst, lo, words.nbytes, words, 0)
        words[offset - lo:offset - lo + src.nbytes] = src
        return words

    def _read_back(self, buf: Buffer, lo: int, size: int, out: np.ndarray, skip: int) -> None:
        """(Worker thread.) Into `out`, its bytes from byte `lo + skip` of `buf`: `size` bytes from `lo` (multiples of
        4) copied into a staging buffer, mapped once that copy is done (which says all before it is)."""
        staging = self.staging.lend(max(size, 4))
        self._submit(lambda enc: enc.copy_buffer_to_buffer(buf.mem, lo, staging.block, 0, size) if size else None)
        staging.block.map_sync("READ", 0, max(size, 4))
        try:
            view = staging.block.read_mapped(0, max(size, 4), copy=False)
            out[:] = np.frombuffer(view, np.uint8)[skip:skip + out.nbytes]
            del view
        finally:
            staging.block.unmap()

    def let_go(self) -> None:
        """The kept bind groups (the memory part lets its pools' buffers go: `Memory.close`)."""
        self.groups.clear()
