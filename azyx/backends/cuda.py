"""The CUDA backend on NVIDIA's cuda-bindings (driver API + NVRTC): kernels in CUDA C from the shared C-family
renderer (matrix products from the tiled kernels of `codegen.templates`), compiled by NVRTC to a cubin for the
device's architecture, launched on one stream per device.

Completion: an event is recorded after each command, and one waiter thread per device waits on them in stream
order (the GIL is released while it waits) and advances the device's TimelineSignal (`queues.QueuedDevice`); nothing
polls the loop.

Waits: on a buffer of another CUDA device, `cuStreamWaitEvent` on the event that produced it. A command that must
wait for progress on the host side (a C kernel's output, a staging copy into pinned memory) is not put on the
stream before it can run: it goes to the event queue's submit thread (as every command of OpenCL, Vulkan and wgpu
does), which puts it on the stream once its conditions hold (every later command queues behind it, so the stream
keeps program order); other commands are put on the stream by their caller.
A GPU-side wait on host memory (a spinning kernel, `cuStreamWaitValue32`) was tried first: it can hold the
device busy while a module load waits for the device to idle, which deadlocks. Copies (the executor routes them):
peer-to-peer between CUDA devices (peer access enabled where the hardware allows it), through pinned staging buffers
to and from host memory, in chunks so the DMA and the host copy overlap.

Steady state: when a single-device plan submits the same kernels on the same buffers again (the caching
allocator hands back the same blocks), its launches replay as one CUDA graph (`begin_batch`/`end_batch`, and
`cuda_graph.GraphCache`).
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import numpy as np

from azyx import debug
from azyx.allocator import Slabs
from azyx.backends.cuda_driver import (
    check,
    cu,
    describe_pointer,
    encode_tensor_map,
    hot,
    init,
    nvrtc_compile,
    sticky,
    versions,
)
from azyx.backends.cuda_graph import INLINE_LAUNCHES, Collected, GraphCache
from azyx.codegen.dialect import CUDA
from azyx.codegen.launch import Launch
from azyx.codegen.templates.gemm_sm90 import TensorMap
from azyx.device import (
    ADDRESSES_KEPT,
    GRAPH,
    INLINE,
    BatchState,
    Buffer,
    Device,
    LaunchItem,
    Lent,
    Replay,
    Runner,
    RunRecord,
    gatherable,
    lone_kernel,
    work_devices,
)
from azyx.errors import AllocationError, CompileError, DeviceError
from azyx.memory import RING, RING_BLOCK
from azyx.native import native
from azyx.plan import ExecutionPlan, KernelStep
from azyx.queues import UNWATCHED, EventQueue, QueuedDevice, run_each

# (spin_us: as opencl's; gather: as c's; peer_reads: kernels read a peer device's buffers in place, `reads_peer`)
CONFIG = {"enabled": True, "memory": None, "spin_us": 20, "gather": True, "peer_reads": True}
AUTO = True
LIBRARIES = ("libcuda.so.1", "libcuda.so")

# blocks of up to SLAB_PIECE bytes are pieces of SLAB-byte slabs, each at an address aligned as cuMemAlloc's (256)
SLAB, SLAB_PIECE, SLAB_ALIGN = 2 << 20, 256 << 10, 256
STAGE = 8 << 20  # bytes per pinned staging chunk of a host <-> device copy
SYNC_STAGE = 1 << 20  # a ready host source up to this size (one chunk) is staged at once; larger on a worker thread


class _Pinned:
    """Page-locked host memory. Owned by a device's staging pool, which frees it when the device closes: never
    with its last reference, because a `__del__` here would run when the cyclic GC finalizes a garbage cycle that
    holds a `device.Lent` of it (whose own `__del__` then puts this block back in the pool: resurrected, with its memory
    freed under it; the driver then hands the address out again, and two blocks alias)."""

    __slots__ = ("nbytes", "ptr", "array")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))


def _kernel_params(ptrs: tuple[int, ...], maps: tuple[TensorMap, ...]) -> tuple[Any, Any, int]:
    """(values, kernelParams, its address) for a launch: the arguments' 64-bit values (buffer pointers, scalar words),
    then each tensor map's 128 bytes (64-byte aligned), encoded over its buffer's address; and a pointer to each."""
    values = array.array("Q", ptrs) + array.array("Q", bytes(8 * (8 + 16 * len(maps))))
    base = values.buffer_info()[0]
    at = (base + 8 * len(ptrs) + 63) & ~63
    for i, m in enumerate(maps):
        ctypes.memmove(at + 128 * i, encode_tensor_map(m, ptrs[m.arg]), 128)
    params = array.array("Q", [*range(base, base + 8 * len(ptrs), 8), *range(at, at + 128 * len(maps), 128)])
    return values, params, params.buffer_info()[0]


class _Frozen:
    """A frozen batch (device.Replay) as CUDA launches it: per kernel its function, dims and name, and where its
    arguments' 64-bit values (buffer addresses, then scalar words: what kernelParams points at) sit in the run's
    table. Its graph is keyed by the addresses a captured memset writes (`zeroed_at`: a memset node is not updated);
    every other value is the graph's data (`refresh`)."""

    __slots__ = ("n", "n_words", "count", "arg_at", "word_at", "entry_kernel", "zeroed_at", "kernels", "nodes",
                 "pointers", "tables")

    def __init__(self, replay: Replay, programs: dict[str, Any]):
        self.arg_at, self.word_at, starts = replay.table_at()
        steps = replay.batch.steps
        self.kernels = [(programs[step.name], step.launch, step.name, a, b)
                        for step, a, b in zip(steps, starts, starts[1:])]
        self.n, self.n_words, self.count = starts[-1], len(self.word_at), len(self.kernels)
        self.entry_kernel = np.repeat(np.arange(len(steps), dtype=np.intp), np.diff(starts))  # each entry's kernel
        # each memset's address (its kernel's first argument), in the run's addresses
        self.zeroed_at = np.array([a for a, step in zip(np.cumsum([0, *replay.arg_counts]), steps) if step.launch.zero],
                                  np.intp)
        self.nodes: list[Any] | None = None  # each kernel's node parameters for an update (`GraphCache.node_params`)
        self.pointers = np.arange(self.n, dtype=np.uint64) * np.uint64(8)  # each value's offset in a table's bytes
        # the last runs' tables, by their addresses' array (kept by `Replay` for runs that bind the same buffers: a
        # chained step's), which each entry holds so that its id stays its own, and their words
        self.tables: dict[tuple[int, bytes], tuple[np.ndarray, np.ndarray]] = {}

    def table(self, addresses: np.ndarray, words: np.ndarray) -> np.ndarray:
        """A run's table: each kernel's buffer addresses (`Replay.addresses`), then its scalar words. Read-only: kept
        for later runs of the same addresses and words."""
        key = (id(addresses), words.tobytes())
        found = self.tables.get(key)
        if found is not None:
            return found[1]
        table = np.empty(self.n, np.uint64)
        table[self.arg_at] = addresses
        if self.n_words:
            table[self.word_at] = words
        table.flags.writeable = False
        if len(self.tables) >= ADDRESSES_KEPT:
            self.tables.pop(next(iter(self.tables)))
        self.tables[key] = (addresses, table)
        return table

    def key(self, addresses: np.ndarray) -> tuple:
        """The run's graph's key: the record, and the addresses its memsets write."""
        return (self, addresses[self.zeroed_at].tobytes()) if len(self.zeroed_at) else (self,)

    def refresh(self, cache: GraphCache, graph: Any, table: np.ndarray, hold_gil: bool) -> int:
        """The executable graph of `graph` this run launches (`_Graph.turn`), its kernels whose values (a new input's
        address, a new scalar) differ from the run's given the run's: a steady batch replays one graph whatever its
        inputs and scalars, capturing nothing."""
        values = table.tobytes()
        exe = graph.turn(values)
        last, graph.tables[exe] = graph.tables[exe], values
        if last is None:  # just captured from this run's launches: every executable graph holds this table
            graph.tables[:] = [values] * len(graph.tables)
            return exe
        if last == values:
            return exe
        changed = self.changed(last, table)
        if self.nodes is None:  # (None: its values encode tensor maps)
            self.nodes = [None if dims.maps else cache.node_params(fn, dims) for fn, dims, _, _, _ in self.kernels]
        # kernelParams point into the table itself (the driver copies the values at the update): `at` holds each
        # value's address, a kernel's kernelParams are its slice of `at`
        at = self.pointers + np.uint64(table.ctypes.data)
        base = at.ctypes.data  # (once: each `.ctypes` makes an object, ~2 us)
        for i in changed:
            fn, dims, _, a, b = self.kernels[i]
            node = self.nodes[i]
            if node is not None:
                node.params = base + 8 * a
                cache.update(graph, exe, i, node, hold_gil)
            else:
                cache.set_params(graph, exe, i, fn, dims, tuple(table[a:b].tolist()), hold_gil)
        return exe

    def changed(self, last: bytes, table: np.ndarray) -> list[int]:
        """The kernels whose values differ between an executable graph's table `last` and the run's `table`."""
        kernels = self.entry_kernel[np.frombuffer(last, np.uint64) != table]  # (ascending: entries in kernel order)
        return kernels[np.concatenate(([True], kernels[1:] != kernels[:-1]))].tolist()

    def updates(self, graph: Any, table: np.ndarray) -> int:
        """How many kernels `refresh` would update for this run (a graph just captured: none)."""
        values = table.tobytes()
        last = graph.tables[graph.pick(values)]
        return 0 if last is None or last == values else len(self.changed(last, table))

    def launches(self, table: np.ndarray) -> list[Collected]:
        """The batch's launches for a run's table (where it is not replayed as a graph yet)."""
        values = table.tolist()
        return [(fn, dims, tuple(values[a:b]), name) for fn, dims, name, a, b in self.kernels]


# ------------------------------------------------------------------------------------------------ the device
class _QueueState:
    """A CUDA device's queue counters and open batch where the native core is not built; otherwise they are
    `native.Queue`'s own members, which its lanes and `poll` advance in C and the device's Python paths through the
    same attributes (`_queue_field`)."""

    __slots__ = ("submitted", "waited", "handed", "demanded", "batch")

    def __init__(self) -> None:
        self.submitted = self.waited = self.handed = self.demanded = 0
        self.batch: list[Collected] | None = None


def _queue_field(name: str, state: str = "queue_state") -> Any:
    """An attribute (of a CUDADevice, of its event queue) that is its queue state's (`CUDADevice.queue_state`, at the
    path `state`): one value, which C and Python both advance. Read through a C getter (no frame of Python): the
    submitting paths read these on every command."""
    holder = operator.attrgetter(state)

    def put(obj: Any, value: Any) -> None:
        setattr(holder(obj), name, value)

    return property(operator.attrgetter(f"{state}.{name}"), put)


class _Queue(EventQueue):
    """A CUDA device's event queue: its counters are the device's queue state's (which C advances too), and where the
    native core is built, what completed commands held is taken in C (`native.Queue.take_done`)."""

    dev: CUDADevice
    submitted, waited = _queue_field("submitted", "dev.queue_state"), _queue_field("waited", "dev.queue_state")
    watched, demanded = _queue_field("handed", "dev.queue_state"), _queue_field("demanded", "dev.queue_state")
    # (a command is on the stream once its event is in `events`, which `query` reads: `poll` may ask of any value)
    through = property(lambda _: 1 << 62, lambda *_: None)

    def take_done(self) -> list[Any]:
        native_queue = self.dev.native_queue
        return native_queue.take_done() if native_queue is not None else super().take_done()


class CUDADevice(QueuedDevice):
    kind = "cuda"
    dialect = CUDA
    event_queue = _Queue
    arena = True
    gathers_copies = True
    tiles = False  # matrix products get the shared-memory kernel of codegen.templates.gemm instead of register tiles

    @classmethod
    def count(cls, options: dict[str, Any]) -> int:
        return int(options["devices"]) if "devices" in options else init()

    # the queue's counters (the last value reserved, handled by the waiter thread) and its open batch: the queue
    # state's (native.Queue's members where the native core is built)
    submitted, waited, batch = _queue_field("submitted"), _queue_field("waited"), _queue_field("batch")

    def __init__(self, index: int, options: dict[str, Any]):
        self.queue_state: Any = _QueueState()  # (first: the base's __init__ sets the counters)
        self.batch_copies = 0  # copies in the open batch (`_submit`), and their host-side ends (`post`s)
        self.batch_posts: list[Callable[[], None]] = []
        super().__init__(index, options)
        count = init()
        if index >= count:
            raise DeviceError(f"no CUDA device {index} (found {count})")
        self.cu_device = check(cu.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        self.ctx_id = int(self.ctx)
        self.hot = hot()  # the launch path's driver calls, on integer handles
        self.use()
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cu_device), "")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cu_device), "")
        self.arch = f"sm_{major}{minor}"
        if major < 8:  # no mma.sync for float16/bfloat16 before Ampere: those products take the generic kernel
            self.dialect = dataclasses.replace(CUDA, tensor_cores=False)
        sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.cu_device), "")
        # compute capability 9.0 compiles for sm_90a, whose wgmma and TMA its float16/bfloat16 products use
        # (codegen's gemm_sm90: a grid of a block per multiprocessor)
        self.sm90 = int(sms) if (major, minor) == (9, 0) else 0
        self.multiprocessors = int(sms)
        self.compile_arch = "sm_90a" if self.sm90 else self.arch
        self.label = check(cu.cuDeviceGetName(256, self.cu_device), "cuDeviceGetName").split(b"\0")[0].decode()
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.stream_h = int(self.stream)
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        self.driver_free = int(free)
        # freed blocks stay cached (like PyTorch's allocator); an allocation the driver refuses empties the cache
        self.mem.open_pool(options, free * 0.9, self._create, lowest=True)
        # blocks up to SLAB_PIECE bytes are carved from slabs of SLAB bytes (`_create`)
        self.slabs = Slabs(SLAB, SLAB_ALIGN, SLAB_PIECE)
        # pinned staging blocks are kept for reuse (freeing page-locked memory synchronises the whole device); once
        # closed, the memory part destroys both kinds of block
        self.staging = self.mem.staging(self._pinned, "staging", view=operator.attrgetter("array"),
                                        destroy=lambda block: cu.cuMemFreeHost(block.ptr))
        self.mem.destroy = self._destroy
        self.pin_ring()
        self.compute = float(sms * 128 * 2 * 1.7)  # FP32 lanes x 2 FLOP x ~GHz: rough GFLOP/s for AUTO placement
        self.free_events: list[Any] = []  # events the waiter thread is past, to record anew
        self.params: dict[tuple, tuple[Any, Any, int]] = {}  # pointers (tensor maps) -> kernelParams (_launch_now)
        self.modules: list[Any] = []
        self.peers: dict[int, bool] = {}
        self.graph_cache: GraphCache = GraphCache(self.stream, self._launch_now, self.name, self._params)
        self._start_native_queue()
        self.queue.start()
        debug.log(debug.DEVICES, f"{self.name}: {self.label} ({self.arch}, {sms} SMs, {total >> 20} MiB)")

    def _start_native_queue(self) -> None:
        """The per-request steps in C (`poll`, `take_done`, the lanes' runs), by a queue that owns the state they
        share with the Python paths (its counters, batch and tables: see `queue_state`); None without the native
        core. A lane's run also writes its value, in stream order after its event, into 8 bytes of mapped host memory
        (`done_flag`), where the device supports 64-bit stream memory operations: `poll` then reads the completion of
        a small plan's work from memory (cuEventQuery takes 2-3 us on an H200's VM)."""
        self.native_queue: Any = None
        self.done_flag = 0
        if native is None or self.hot.addresses is None:
            return
        attr = cu.CUdevice_attribute
        flag = (0, 0)
        if self.hot.addresses[4] and int(check(cu.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, self.cu_device), "")):
            self.done_flag = int(check(cu.cuMemHostAlloc(64, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
            ctypes.memset(self.done_flag, 0, 64)
            flag = (self.done_flag, int(check(cu.cuMemHostGetDevicePointer(self.done_flag, 0), "")))
        queue = native.Queue(
            device=self, timeline=self.timeline, pool=self.allocator.pool, lock=self.queue.lock,
            qlock=self.queue.qlock, deferred=self.queue.pending, posts=self.queue.posts, alloc=self.alloc, use=self.use,
            new_event=self._new_event, watch=self.queue.watch, fail=self.hot.fail, check_alive=self.check_alive,
            buffer=Buffer, record=RunRecord, fns=self.hot.addresses, flag=flag, ctx=self.ctx_id, stream=self.stream_h,
            unwatched_max=UNWATCHED)
        # from here the queue's state is the native queue's own: its counters and batch, and its tables
        assert not (self.queue.holding or self.queue.events or self.free_events or self.queue.unwatched
                    or self.submitted)
        self.queue_state = self.native_queue = queue
        self.queue.holding, self.queue.events = queue.holding, queue.events
        self.free_events, self.queue.unwatched = queue.free_events, queue.unwatched

    def identity(self) -> dict[str, Any]:
        """The GPU (name, compute capability: the base's label and arch), the driver's and NVRTC's versions."""
        return {**super().identity(), **versions()}

    def use(self) -> None:
        """Make this device's context current on the calling thread. Asked of the driver each time, not remembered
        per thread: other code on the thread (PyTorch's set_device, another device of ours) may have made another
        context current since."""
        if self.hot.current_context() != self.ctx_id:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    # ------------------------------------------------------------------ memory
    def _create(self, size: int) -> int:
        """A new block for the pool: a small one is a piece of a slab (cuMemAlloc takes 0.3-1.5 ms on an H200's host,
        on the loop's thread when a crowd's pool grows), a larger one the driver's own."""
        return self.slabs.block(None, size, self._driver_alloc, lambda slab, at, _: slab + at)

    def _destroy(self, ptr: int) -> None:
        """(Closed: the memory part's `destroy`.) A block back to the driver; a piece, its slab once it was the last."""
        self.use()
        self.slabs.destroy(ptr, cu.cuMemFree)

    def _driver_alloc(self, size: int) -> int:
        self.use()
        err, ptr = cu.cuMemAlloc(size)
        if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            self.empty_cache()
            err, ptr = cu.cuMemAlloc(size)
        if int(err) != 0:
            raise AllocationError(f"{self.name}: cuMemAlloc of {size} bytes failed: {cu.cuGetErrorName(err)[1]}")
        self.driver_free -= size
        return int(ptr)

    def empty_cache(self) -> None:
        """Return every cached block to the driver, but the pieces of slabs (they stay cached, for the next small
        blocks; the slabs go when the device closes)."""
        self.use()
        for ptr in self.allocator.take_cached(keep=self.slabs.of.__contains__):
            cu.cuMemFree(ptr)
        self.driver_free = int(check(cu.cuMemGetInfo(), "cuMemGetInfo")[0])

    def free_memory(self) -> int:
        """What this device can still take: its budget less what is in use, and no more than the driver has free
        (other processes share the GPU) plus the blocks cached here."""
        return max(0, min(self.capacity - self.allocator.in_use, self.driver_free + self.allocator.cached))

    def alloc(self, nbytes: int) -> Buffer:
        ptr, size = self.allocator.alloc(nbytes)
        return Buffer(self, size, ptr, ptr, True)

    def alloc_many(self, sizes: list[int]) -> list[Buffer]:
        return [Buffer(self, size, ptr, ptr, True) for ptr, size in self.allocator.alloc_many(sizes)]

    # ------------------------------------------------------------------ compile and launch
    def build(self, src: str, steps: list[KernelStep]) -> dict[str, Any]:
        """NVRTC's cubin (cached on disk), loaded as a module: per kernel its CUfunction. On a worker thread: a module
        load takes milliseconds, and waits for the device to idle."""
        names = [s.name for s in steps]
        try:
            cubin = nvrtc_compile(src, self.compile_arch)
        except CompileError as e:
            raise self.builder.failed("NVRTC's compile", names, e, src) from None
        self.use()
        try:
            module = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
            self.modules.append(module)
            fns = {name: check(cu.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction") for name in names}
            limit = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            for s in steps:  # a kernel may take more than 48 KiB of dynamic shared memory once allowed to
                if s.launch.smem > 48 << 10:
                    check(cu.cuFuncSetAttribute(fns[s.name], limit, s.launch.smem), "cuFuncSetAttribute")
            return {name: int(fn) for name, fn in fns.items()}
        except DeviceError as e:  # a module load waits for the device to idle: it meets a kernel that faulted first
            if sticky(e):
                raise self.fail(e) from None
            raise

    def native_wait(self, dev: Device, v: int) -> Any:
        """The event (and value) of a command on another CUDA device's stream (None: host-side progress, or a CUDA
        command still deferred)."""
        ev = dev.queue.events.get(v) if isinstance(dev, CUDADevice) else None
        return (ev, v) if ev is not None else None

    def _new_event(self) -> Any:
        return check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def _event(self) -> Any:
        ev = self.free_events.pop() if self.free_events else self._new_event()
        if err := self.hot.here().event_record(int(ev), self.stream_h):  # (on the loop, or the submit thread)
            self.hot.fail(err, "cuEventRecord")
        return ev

    def _submit(self, enqueue: Callable[[], None], waits: list[tuple[Device, int]], keep: Any,
                post: Callable[[], None] | None = None, host_wait: Callable[[], None] | None = None,
                long: Callable[[], None] | None = None, copy: bool = False) -> int:
        """Put work on the stream after `waits` (`queue.enqueue`: now, where every wait is an event and nothing is
        queued for the submit thread, else by that thread once it can go on the GPU); returns its timeline value.
        `host_wait` blocks (on the submit thread) until host-side inputs are ready; `post` runs on the waiter thread
        once the work completed, before the timeline reaches its value. `long`: the work takes milliseconds to enqueue
        (launches one by one, a capture): the submit thread runs it instead. `copy`: a small copy between pinned
        staging and the device, which joins the open batch where one is (a run's, a crowd's gather) and waits for
        nothing: one command and one event with the batch's launches, in their order."""
        with self.queue.lock:
            batch = self.batch
            if copy and batch is not None and not waits:
                # (a Collected of no function: `_in_order` calls it; the batch is then never a graph, whose copies'
                # host blocks would differ from run to run)
                batch.append(cast(Collected, (None, enqueue, (), "copy")))
                self.batch_copies += 1
                if post is not None:
                    self.batch_posts.append(post)
                return self.queue.reserve(keep, post is not None)  # (the batch's event completes it: `_flush`)
            if batch:  # launches collected so far go first: the stream is in order
                self._flush(self.batch)
                self.batch = []
            inline = host_wait is None and long is None and not self.queue.native_waits(waits)[1]
            return self.queue.enqueue((host_wait, long or enqueue, 0), waits, keep, post, inline)

    def submit(self, run: Any, waits: list[tuple[Device, int]], v: int) -> Any:
        """(The submit thread, or the caller under the lock: `_submit`.) Once its host-side inputs are ready and each
        CUDA command it waits for is on its stream, the command on the stream after the events of `waits` (the rest,
        host devices', waited for here); returns its event, which completes the values from its `first` on (a batch's).
        A command whose waits or enqueue failed is left out, its failure recorded: its event still completes it."""
        host_wait, enqueue, first = run
        try:
            if host_wait is not None:
                host_wait()
            for dev, u in self.queue.native_waits(waits)[1]:  # (none where it is submitted by the caller)
                if isinstance(dev, CUDADevice):
                    dev.queue.submitted_to(u)
            native, ok = self.queue.host_waited(waits, v)
            if ok:
                with self.queue.lock:
                    self.use()
                    for ev, _ in native:
                        check(cu.cuStreamWaitEvent(self.stream, ev, 0), "cuStreamWaitEvent")
                # outside the lock on the submit thread (a long batch's launches take milliseconds, and the loop's
                # thread takes the lock to submit or poll): while this command is pending, every later one queues
                # behind it, so the stream is this thread's alone
                enqueue()
        except BaseException as e:  # the command is lost; its value still completes, and its run raises the error
            self.record_failure(v, e, first)
            if sticky(e):
                self.fail(e)
        try:
            with self.queue.lock:
                self.use()
                ev = self._event()
                for u in range(first or v, v + 1):
                    self.queue.events[u] = ev
                return ev
        except BaseException as e:  # no event: its completion cannot be known, the context is lost
            return self.lost(v, e)

    def on_waiter_thread(self) -> None:
        self.use()

    def wait_event(self, ev: Any, v: int) -> bool:
        if ev is False:  # (no event: `submit`, the device failed)
            return False
        err = cu.cuEventSynchronize(ev)[0]  # releases the GIL while it waits
        if int(err) == 0:
            return True
        # a kernel that faulted (illegal address, trap) leaves the context unusable (a sticky error): the device
        # fails, and every waiter on it gets DeviceFailedError instead of waiting forever
        return self.lost(v, DeviceError(f"{self.name}: command {v} failed: {cu.cuGetErrorName(err)[1].decode()}"))

    def retire(self, v: int, ev: Any) -> None:
        if self.queue.events.get(v + 1) is not ev:  # a batch's values share one event: free once its last value is past
            self.free_events.append(ev)

    def poll(self, v: int, spin: float = 0.0) -> bool:
        """(QueuedDevice's: a small plan's event is complete a few microseconds after its launch.) In C where the
        native core is built."""
        if self.native_queue is not None:
            return self.native_queue.poll(v, spin)
        return super().poll(v, spin)

    def query(self, v: int) -> Callable[[], bool] | None:
        """The command's event, once recorded: complete (an error is left for the waiter thread to report)."""
        ev = self.queue.events.get(v)
        if ev is None:
            return None
        query, handle = self.hot.event_query, int(ev)
        return lambda: query(handle) == 0

    def _launch_now(self, fn: Any, dims: Launch, ptrs: tuple[int, ...], hold_gil: bool = True) -> None:
        grid, block, zero = dims.grid, dims.group, dims.zero
        hot = self.hot if hold_gil else self.hot.releasing
        if zero and (err := hot.memset_d32(ptrs[0], 0, zero // 4, self.stream_h)):
            hot.fail(err, "cuMemsetD32Async")
        # kernelParams: one pointer per argument, to where its value (a device pointer) is. `array`s, not ctypes
        # arrays (a ctypes array type per argument count is garbage for the cyclic GC on every launch). The driver
        # copies them at launch, so the pair is kept for the next launch with these pointers (a steady plan's)
        maps = dims.maps
        if not maps and hot.launch_values is not None:  # (the parameters' table made in C)
            if err := hot.launch_values(fn, *grid, block, 1, 1, dims.smem, self.stream_h, ptrs):
                hot.fail(err, "cuLaunchKernel")
            return
        if err := hot.launch(fn, *grid, block, 1, 1, dims.smem, self.stream_h, self._params(ptrs, dims), None):
            hot.fail(err, "cuLaunchKernel")

    def _params(self, ptrs: tuple[int, ...], dims: Launch) -> int:
        """kernelParams' address for a launch of `ptrs` (the driver copies them at the call: the arrays are kept for
        the next launch with these values, a steady plan's)."""
        maps = dims.maps
        key = (ptrs, maps) if maps else ptrs
        arrays = self.params.get(key)
        if arrays is None:
            if len(self.params) >= 4096:
                self.params.clear()
            arrays = self.params[key] = _kernel_params(ptrs, maps)
        return arrays[2]

    def launch_many(self, items: list[LaunchItem], waits: list[tuple[Device, int]],
                    batch: BatchState | None = None) -> int:
        """Kernels in a row: collected into the batch (a single-device plan's, open for its whole run; for a plan over
        several devices, a GRAPH batch of their own, after the first kernel when that one waits), so they cost one event
        and, once steady, one graph launch. An INLINE batch (one kernel) outside a run-long batch is one command."""
        if batch is None:
            batch = self.batch_of(items)
        v = 0
        if waits or (self.batch is None and batch.how is INLINE):
            step, bufs, words = items[0]
            # (per kernel, not per name: kernels of one source may differ in grid.) kernelParams points at each 64-bit
            # value, the buffers' device pointers then the scalars' words (the driver reads as many low bytes as the
            # parameter has), and a steady batch's graph is keyed by them all
            fn, dims, ptrs = self.programs[step.name], step.launch, tuple([b.ptr for b in bufs]) + words
            v = self._submit(lambda: self._launch_now(fn, dims, ptrs), waits, bufs)
            items = items[1:]
            if not items:
                return v
        own = self.batch is None
        if own:
            self.begin_batch()
        try:
            assert self.batch is not None
            programs = self.programs
            # (one comprehension for the run: a plan step's hundreds of kernels pay no call each)
            self.batch += [(programs[s.name], s.launch, tuple([b.ptr for b in bufs]) + w, s.name)
                           for s, bufs, w in items]
            self.submitted += len(items)  # reserved: end_batch records the event that completes them
            v = self.submitted
            self.queue.holding[v] = [bufs for _, bufs, _ in items]
        finally:
            if own:
                self.end_batch()
        return v

    def reads_peer(self, other: Device) -> bool:
        """Another CUDA device of this process with peer access between the two (turned on here, once): this
        device's kernels read its buffers over the link (a two-GPU all-reduce: each reads the other's piece, the two
        links at once, with no copy)."""
        if not isinstance(other, CUDADevice) or other is self or not self.options.get("peer_reads", True):
            return False
        return self._enable_peer(other)

    def freeze(self, replay: Replay) -> bool:
        """A steady batch replays as one table of its launches' 64-bit values (`_Frozen`), the data of one graph per
        record: a steady run's submission is one dict lookup, a parameter update per kernel whose values changed (a
        new input buffer, a new scalar), and one graph launch."""
        replay.prepared = _Frozen(replay, self.programs)
        return True

    def launch_replay(self, replay: Replay, bufs: list[Any], arena: Buffer | None, scalars: Sequence[Any],
                      waits: list[tuple[Device, int]]) -> int:
        """As `launch_many` for the frozen batch: one command (one value, one event), its launches one by one until
        steady, then captured and replayed as a graph (`GraphCache`, keyed by the record, its values updated): here
        where that is cheap, else by the submit thread (as `_flush`; also where a wait needs host-side progress)."""
        frozen = replay.prepared
        addresses = replay.addresses(bufs, arena)
        table = frozen.table(addresses, replay.words(scalars))
        key, cache = frozen.key(addresses), self.graph_cache

        def launch(hold_gil: bool = True) -> None:
            cache.launch(lambda: frozen.launches(table), hold_gil, key,
                         lambda graph: frozen.refresh(cache, graph, table, hold_gil))

        cheap = cache.cheap_keyed(key, frozen.count, lambda graph: frozen.updates(graph, table))
        long = None if cheap else lambda: launch(False)
        return self._submit(launch, waits, (arena, replay.get(bufs)), long=long)

    def prepare_batch(self, batch: BatchState) -> None:
        """One kernel: INLINE (a command of its own, where no run-long batch is open); more: GRAPH (collected, one
        event, replayed as a graph once steady)."""
        batch.how = INLINE if len(batch.steps) == 1 else GRAPH

    def prepare(self, plan: ExecutionPlan, batches: list[BatchState]) -> Runner:
        """A single-device plan's launches are collected for its whole run (`together`: one batch, one graph once
        steady); a plan of one kernel (`lone_kernel`) runs as one C call (`native.Lane`): what `begin_batch`, `alloc`,
        `launch_many` and `end_batch` do for a batch of one launch, and the executor's bookkeeping of the run, with no
        Python between the call and the launch. No lane without the native core, or for a kernel that takes tensor
        maps or a zeroed output (their launch is made here, in Python). A crowd's runs are gathered (`gathers`) for
        a plan without a lane only."""
        runner = super().prepare(plan, batches)
        runner.together = work_devices(plan) == [self.name]  # (its inputs' uploads join the batch: `_submit`)
        runner.gathers = self.gather_runs and gatherable(plan, uploads=self.gathers_copies)
        step = lone_kernel(plan)
        if step is None or not runner.together or native is None or self.native_queue is None or step.launch.maps \
                or step.launch.zero:  # (a plan of several devices: its one kernel may be another's, reading here)
            return runner
        dims = step.launch
        sizes = tuple(-1 if i < plan.n_inputs else max(s.nbytes, 1) for i, s in enumerate(plan.slots))
        runner.lane = native.Lane(self.native_queue, self.programs[step.name], tuple(dims.grid), dims.group, dims.smem,
                                  step.args, step.outs, plan.n_inputs, sizes, plan.outputs, step.pack)
        # a lane's run (one C call) costs less than a gathered run through the executor's Python path: on an H200 a
        # crowd of 8 realizes of a 10-op graph took 61.5 us each gathered, 29.5 alone (jit replays: 53.9 vs 24.7)
        runner.gathers = False
        return runner

    # ------------------------------------------------------------------ copies (the executor routes each transfer)
    def _pinned(self, size: int) -> _Pinned:
        """A new pinned block for the staging pool."""
        self.use()  # pinned memory is allocated in a context, on whichever thread needs staging
        return _Pinned(size)

    def pin_ring(self) -> None:
        """Pin a load's ring of staging blocks (RING of RING_BLOCK bytes: memory.Ring) into the staging
        pool now, at the device's start (a worker thread): the ring takes them from the pool's cache (`host_staging`)
        on the loop's thread, and no load pins memory beside the loop's driver calls (cuMemHostAlloc holds the
        driver's lock for milliseconds)."""
        blocks = [self.staging.lend(RING_BLOCK) for _ in range(RING)]
        del blocks  # (back to the pool, which keeps them cached)

    def copy(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        return self._submit(lambda: check(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, n, self.stream), "copy"), waits,
                            (src, dst))

    def copy_peer(self, src: Buffer, dst: Buffer, n: int, waits: list[tuple[Device, int]]) -> int:
        sdev = cast(CUDADevice, src.device)
        self._enable_peer(sdev)
        return self._submit(lambda: check(cu.cuMemcpyPeerAsync(dst.ptr, self.ctx, src.ptr, sdev.ctx, n, self.stream),
                                          "cuMemcpyPeerAsync"), waits, (src, dst))

    def host_staging(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A pinned block the staging pool has cached, to be read into and then copied from with one DMA. Else plain
        host memory: this runs on the loop, and pinning fresh memory takes milliseconds, so `copy_from_host` stages
        that through pinned chunks on a worker thread instead (whose blocks the pool then keeps for the next time)."""
        if (staged := self.staging.cached(nbytes)) is None:
            return super().host_staging(nbytes)
        return staged.block.array[:nbytes], staged

    def staging_block(self, nbytes: int) -> tuple[np.ndarray, Any]:
        """A pinned block from the staging pool, pinned now when it has none cached (worker threads only)."""
        return self.staging.host(nbytes)

    def copy_from_host(self, host: np.ndarray, dst: Buffer, waits: list[tuple[Device, int]], keep: Any,
                       offset: int = 0) -> int:
        """From this device's pinned staging (`host_staging`, `staging_block`: `keep` is its block, `host` that block
        or a part of it): one DMA. From other host memory: through pinned chunks, overlapped (`_upload`)."""
        n = host.nbytes
        if isinstance(keep, Lent) and keep.pool is self.staging.pool:
            src = host.ctypes.data if n else keep.block.ptr

            def dma() -> None:
                if n and (err := self.hot.here().htod(dst.ptr + offset, src, n, self.stream_h)):
                    self.hot.fail(err, "H2D")

            return self._submit(dma, waits, (keep, dst))
        return self._upload(host.reshape(-1).view(np.uint8), dst, offset, waits, (keep, dst))

    def _upload(self, flat: np.ndarray, dst: Buffer, offset: int, waits: list[tuple[Device, int]], keep: Any) -> int:
        """Host bytes `flat` -> this device (into `dst` from byte `offset`) through pinned chunks. A ready source of up
        to SYNC_STAGE bytes (one chunk) is staged here; otherwise each chunk's DMA is a command that the submit thread
        puts on the stream once it has filled the chunk (the first once the source is ready): the DMA of one chunk
        overlaps the filling of the next."""
        n = flat.nbytes
        chunks = [(o, min(STAGE, n - o)) for o in range(0, n, STAGE)] or [(0, 0)]
        # each chunk's pinned block, in a cell of its own that its DMA command keeps (back to the pool once that DMA
        # is done); taken from the pool by whoever fills the chunk: pinning fresh memory takes milliseconds per chunk
        stages: list[list[Lent]] = [[] for _ in chunks]

        def dma(i: int) -> None:
            o, size = chunks[i]
            if size:
                pinned, at = stages[i][0].block, dst.ptr + offset + o
                if err := self.hot.here().htod(at, pinned.ptr, size, self.stream_h):  # (often the submit thread's)
                    self.hot.fail(err, f"H2D of {size} bytes to {at:#x} (of {dst.nbytes}) from {pinned.ptr:#x}")

        def fill_chunk(i: int, staged: Lent | None = None) -> None:
            for d, u in waits if i == 0 else []:  # (the source is ready once they are reached)
                d.timeline.wait_sync(u)
            o, size = chunks[i]
            stages[i].append(staged or self.staging.lend(max(size, 1)))
            stages[i][0].block.array[:size] = flat[o:o + size]

        if n <= SYNC_STAGE and all(d.timeline.value >= v for d, v in waits):
            # staged here from a block the pool has cached; else (pinning fresh memory takes milliseconds, and this
            # may be the loop's thread) as a large source is, on the submit thread
            cached = self.staging.cached(max(n, 1))
            if cached is not None:
                fill_chunk(0, cached)
                return self._submit(partial(dma, 0), [], (keep, stages), copy=True)
        v = 0
        for i in range(len(chunks)):
            v = self._submit(partial(dma, i), [], (keep, stages[i]), host_wait=partial(fill_chunk, i))
        return v

    def _enable_peer(self, other: CUDADevice) -> bool:
        """Peer access between the two contexts, both ways (a copy may run on either one's stream, a kernel of either
        may read the other's memory); whether it is on."""
        if other.index in self.peers:
            return self.peers[other.index]
        can = all(check(cu.cuDeviceCanAccessPeer(a.cu_device, b.cu_device), "cuDeviceCanAccessPeer")
                  for a, b in ((self, other), (other, self)))
        if can:
            for a, b in ((self, other), (other, self)):
                a.use()
                err = cu.cuCtxEnablePeerAccess(b.ctx, 0)[0]
                if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    check((err,), "cuCtxEnablePeerAccess")
            self.use()
        self.peers[other.index] = other.peers[self.index] = can
        debug.log(debug.DEVICES, f"{self.name} <-> {other.name}: peer access {'on' if can else 'unavailable'}")
        return can

    def copy_to_host(self, buf: Buffer, out: np.ndarray, waits: list[tuple[Device, int]], offset: int = 0) -> int:
        """A read in stream order into the host array `out`, overlapped: each chunk's DMA lands in pinned memory and
        the waiter thread copies it out while the next chunk's DMA runs. Returns the last chunk's value."""
        n = out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        v = 0
        for o in range(0, max(n, 1), STAGE):
            size = min(STAGE, n - o)
            cell: list[Lent] = []  # its pinned block: taken here when small, else on the submit thread

            def take(size: int = size, cell: list[Lent] = cell) -> None:
                cell.append(self.staging.lend(max(size, 1)))

            def enqueue(o: int = o, size: int = size, cell: list[Lent] = cell) -> None:
                if size:
                    staged = cell[0]
                    at = buf.ptr + offset + o
                    if err := self.hot.here().dtoh(staged.block.ptr, at, size, self.stream_h):
                        raise DeviceError(f"D2H of {size} bytes ({err}): from {describe_pointer(at)} (of "
                                          f"{buf.nbytes}, {buf.device.name}) to {describe_pointer(staged.block.ptr)} "
                                          f"in {cu.cuCtxGetCurrent()}, device ctx {self.ctx}")

            def post(o: int = o, size: int = size, cell: list[Lent] = cell) -> None:
                flat[o:o + size] = cell[0].block.array[:size]  # on the waiter thread

            # a small read takes a block the pool has cached; pinning fresh memory takes milliseconds (1.2 ms for a
            # few bytes on an H200's host): never on the caller's (the loop's) thread, but the submit thread's
            staged = self.staging.cached(max(size, 1)) if n <= SYNC_STAGE else None
            if staged is not None:
                cell.append(staged)
                v = self._submit(enqueue, waits if o == 0 else [], (buf, cell, out), post, copy=True)
            else:
                v = self._submit(enqueue, waits if o == 0 else [], (buf, cell, out), post, host_wait=take)
        return v

    # ------------------------------------------------------------------ graphs of a steady plan
    def begin_batch(self) -> None:
        """Launches until `end_batch` are collected, then submitted together (as a CUDA graph once steady)."""
        self.queue.lock.acquire()  # held through the batch: other threads' enqueues come before or after it
        self.batch = []
        # what completed work held goes back to the pools before the plan allocates (the waiter thread gives back what
        # it saw complete; this, what `poll` saw first): a steady loop then gets the same blocks each time, and its
        # batch the same key (a graph replay)
        self.queue.take_done()

    def end_batch(self) -> None:
        batch, self.batch = self.batch, None
        try:
            assert batch is not None
            if batch:
                self._flush(batch)
        finally:
            self.queue.lock.release()

    # a gather (Runner.gathers: a crowd's runs in one loop iteration) is a batch open across runs: one event for all of
    # them and, once steady, one graph launch; a command submitted meanwhile comes after the launches collected so far
    # (`_submit`), and other threads' submissions wait on the lock until the gather is closed (the next iteration)
    open_gather, close_gather = begin_batch, end_batch

    def gather_launch(self, items: list[LaunchItem], batch: BatchState) -> int:
        return self.launch_many(items, [], batch)

    def _flush(self, batch: list[Collected]) -> None:
        """Under the lock: submit the batch's launches (reserved values first..last) as one command, one event: here
        where that is cheap, else (a long batch launched one by one, or captured into a graph, takes milliseconds) by
        the submit thread, letting the loop's thread have the GIL between launches. A batch with copies (`_submit`)
        runs in order, its copies' `post`s on the waiter thread once it completed."""
        first = self.submitted - len(batch) + 1
        if self.batch_copies:
            posts, self.batch_posts, self.batch_copies = self.batch_posts, [], 0
            cheap = len(batch) <= INLINE_LAUNCHES
            self.queue.enqueue((None, partial(self._in_order, batch, cheap), first), [], None,
                               partial(run_each, posts) if posts else None, inline=cheap, first=first)
            return
        cheap = self.graph_cache.cheap(batch)
        launch = partial(self.graph_cache.launch, batch, cheap)
        self.queue.enqueue((None, launch, first), [], None, inline=cheap, first=first)

    def _in_order(self, batch: list[Collected], hold_gil: bool) -> None:
        """A batch with copies on the stream: each launch or copy (a Collected of no function) in turn."""
        for fn, dims, ptrs, _ in batch:
            if fn is None:
                cast(Callable[[], None], dims)()
            else:
                self._launch_now(fn, dims, ptrs, hold_gil)

    def drain(self) -> None:
        """(`close`, the submit thread stopped) Finish the stream."""
        try:
            self.use()
            cu.cuStreamSynchronize(self.stream)
        except Exception:
            pass

    def let_go(self) -> None:
        """(`close`) The lanes' completion flag goes (the executor's devices are closed: no lane reads it); the memory
        part then gives the cached blocks back to the driver (a block still lent out goes as it comes back: it may
        still be read)."""
        if self.done_flag:
            self.native_queue = None
            cu.cuMemFreeHost(self.done_flag)
            self.done_flag = 0
