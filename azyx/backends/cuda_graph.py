"""CUDA graphs of steady batches. A single-device plan's launches on a CUDA device are collected into one batch
(`CUDADevice.begin_batch`/`end_batch`); when a plan submits the same kernels on the same buffers again (the caching
allocator hands back the same blocks), the batch is captured once and then replays as one graph launch.

A frozen batch's graph is keyed by its record (and the addresses its memsets write): its kernels' values are data. A
run whose values differ from the graph's last ones updates the parameters of the kernels whose values changed
(cuGraphExecKernelNodeSetParams) before the launch, so new input buffers and scalars every run (a decode step's
tokens and positions) replay one graph, capturing nothing."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from azyx import debug
from azyx.backends.cuda_driver import check, cu, hot
from azyx.codegen.launch import Launch

GRAPH_AFTER = 2  # a batch seen this many times with the same buffers is captured into a CUDA graph
INLINE_LAUNCHES = 16  # a batch of more launches, not replayed as a graph, is submitted off the loop's thread (as is
# a batch's capture)
INLINE_UPDATES = 48  # a graph launch needing more parameter updates (a few us each) is submitted off the loop's thread:
# a crowd's first steps, on buffers new to every executable graph, update each kernel (~125 for GPT-2 small)
GRAPHS_KEPT = 256  # batches (graphs or sighting counts) remembered: plans that come and go keep the cache bounded
# executable graphs instantiated per frozen batch (`_Graph.turn`): a run launches the one that already holds its values
# where one does (runs that take a few sets of buffers in turn; each update is a driver call of several us. A chained
# GPT-2 decode step's buffers were measured not to come back within 6 steps: ~34 updates a step), else updates the one
# launched longest ago (a parameter update of an executable
# graph whose last launch is still running makes the driver wait for that launch on the calling thread: a decode step
# chained behind the one in flight waited a whole step, 636 us of a 1.55 ms step on an H200)
EXECS = 4

Collected = tuple[Any, Launch, tuple[int, ...], str]  # a batch's launch: function, dims, argument words, kernel name


class _NodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS (the driver's first version of it: what cuGraphExecKernelNodeSetParams takes)."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


class _Graph:
    """A captured batch: its executable graphs (one; a frozen batch's: EXECS, `turn`); for a frozen batch, the graph
    they were made from (its kernel nodes, in launch order, are what a parameter update names) and, per executable
    graph, the table of values it replays now (bytes)."""

    __slots__ = ("exes", "handles", "graph", "nodes", "tables", "order")

    def __init__(self, exes: list[Any], graph: Any, nodes: list[int]):
        self.exes, self.handles, self.graph, self.nodes = exes, [int(e) for e in exes], graph, nodes
        self.tables: list[bytes | None] = [None] * len(exes)
        self.order = list(range(len(exes)))  # the executable graphs, launched longest ago first

    def pick(self, table: bytes) -> int:
        """The executable graph a run of values `table` launches: one that holds them already (no update), else the
        one launched longest ago (updated: `_Frozen.refresh`)."""
        return next((i for i in reversed(self.order) if self.tables[i] == table), self.order[0])

    def turn(self, table: bytes) -> int:
        """`pick`, now the graph launched last."""
        i = self.pick(table)
        self.order.remove(i)
        self.order.append(i)
        return i

    def __del__(self) -> None:
        if self.graph is not None:
            cu.cuGraphDestroy(self.graph)


class GraphCache:
    """One stream's graphs, by the launches they replay (kernel names, grids and pointers: one source may launch
    several grids); a batch not yet steady has a count of sightings instead."""

    def __init__(self, stream: Any, launch: Callable[[Any, Launch, tuple[int, ...], bool], None], name: str,
                 params: Callable[[tuple[int, ...], Launch], int] | None = None):
        self.stream, self.launch_one, self.name = stream, launch, name
        self.params = params  # a launch's kernelParams (void**) for its values, kept alive by the caller
        self.hot, self.stream_h = hot(), int(stream)
        self.graphs: dict[tuple, _Graph | int] = {}
        self.keyed: tuple[list[Collected], tuple] | None = None  # the last batch `cheap` keyed, and its key

    @staticmethod
    def key(batch: list[Collected]) -> tuple:
        # (the launch's fields, not the Launch: a dataclass's hash is Python code, a tuple of ints' is not)
        return tuple([(name, dims.grid, dims.group, dims.zero, ptrs) for _, dims, ptrs, name in batch])

    def cheap(self, batch: list[Collected]) -> bool:
        """Whether submitting the batch takes little time: one graph launch, or a few launches where this sighting
        does not capture the batch (a capture and its instantiation take milliseconds: the caller's submit thread
        does it, never the loop's)."""
        if len(batch) == 1:
            return True
        key = self.key(batch)
        self.keyed = (batch, key)
        return self.cheap_keyed(key, len(batch))

    def cheap_keyed(self, key: tuple, launches: int, updates: Callable[[_Graph], int] | None = None) -> bool:
        """`cheap` for a batch of `launches` keyed by its caller (a frozen batch's key: `CUDADevice.launch_replay`);
        `updates(graph)`: how many parameter updates its graph's launch would make (at most INLINE_UPDATES: cheap)."""
        graph = self.graphs.get(key)
        if isinstance(graph, _Graph):
            return updates is None or updates(graph) <= INLINE_UPDATES
        return launches <= INLINE_LAUNCHES and (graph or 0) + 1 < GRAPH_AFTER

    def launch(self, batch: list[Collected] | Callable[[], list[Collected]], hold_gil: bool = True,
               key: tuple | None = None, refresh: Callable[[_Graph], int] | None = None) -> None:
        """Under the device's lock: the batch's launches on the stream, one graph launch once the batch is steady.
        `hold_gil` False: each launch lets other threads run (a long batch submitted off the loop's thread). With
        `key` (a frozen batch's), `batch` is what makes its launches, called only where they are launched one by one
        or captured, and `refresh(graph)` picks the executable graph to launch (`_Graph.turn`) and brings its values up
        to the run's."""
        if key is None:
            assert isinstance(batch, list)
            if len(batch) == 1:
                fn, dims, ptrs, _ = batch[0]
                self.launch_one(fn, dims, ptrs, hold_gil)
                return
            keyed = self.keyed  # (once: the submit thread's launch and the loop's `cheap` may interleave)
            key = keyed[1] if keyed is not None and keyed[0] is batch else self.key(batch)
            self.keyed = None
        graph = self.graphs.get(key)
        if not isinstance(graph, _Graph):
            launches = batch if isinstance(batch, list) else batch()
            seen = (graph or 0) + 1
            if seen < GRAPH_AFTER:
                self.graphs[key] = seen
                for fn, dims, ptrs, _ in launches:
                    self.launch_one(fn, dims, ptrs, hold_gil)
                graph = None
            else:
                graph = self.graphs[key] = self._capture(launches, hold_gil, refresh is not None)
        if graph is None:
            return
        i = refresh(graph) if refresh is not None else 0
        if err := (self.hot if hold_gil else self.hot.releasing).graph_launch(graph.handles[i], self.stream_h):
            self.hot.fail(err, "cuGraphLaunch")
        if len(self.graphs) > GRAPHS_KEPT:
            self.graphs.pop(next(iter(self.graphs)))

    def _capture(self, batch: list[Collected], hold_gil: bool, nodes: bool = False) -> _Graph:
        """The batch captured and instantiated; with `nodes`, each launch's kernel node is noted (the stream's
        capture frontier after it) and the graph kept for parameter updates."""
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        kernels: list[int] = []
        try:
            for fn, dims, ptrs, _ in batch:
                self.launch_one(fn, dims, ptrs, hold_gil)
                if nodes:
                    kernels.append(_frontier(self.stream))
        finally:
            graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        exes = [check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate") for _ in range(EXECS if nodes else 1)]
        debug.log(debug.PLANS, f"{self.name}: captured {len(batch)} launches as a CUDA graph")
        if not nodes:
            cu.cuGraphDestroy(graph)
            return _Graph(exes, None, [])
        return _Graph(exes, graph, kernels)

    @staticmethod
    def node_params(fn: Any, dims: Launch, params: int | None = None) -> _NodeParams:
        """A kernel's node parameters: its function and grid, and `params` (its kernelParams' address; None: set by
        each `update`)."""
        return _NodeParams(int(fn), (ctypes.c_uint * 3)(*dims.grid), (ctypes.c_uint * 3)(dims.group, 1, 1), dims.smem,
                           params, None)

    def update(self, graph: _Graph, exe: int, i: int, node: _NodeParams, hold_gil: bool) -> None:
        """The `i`th kernel of the graph's executable graph `exe` launches as `node` says (its kernelParams read by the
        driver during this call) from its next launch on."""
        hot = self.hot if hold_gil else self.hot.releasing
        if err := hot.graph_set_params(graph.handles[exe], graph.nodes[i], ctypes.byref(node)):
            hot.fail(err, "cuGraphExecKernelNodeSetParams")

    def set_params(self, graph: _Graph, exe: int, i: int, fn: Any, dims: Launch, values: tuple[int, ...],
                   hold_gil: bool) -> None:
        """`update` with `values` (the kernel's buffers' addresses, then its scalar words; tensor maps encoded)."""
        assert self.params is not None
        self.update(graph, exe, i, self.node_params(fn, dims, self.params(values, dims)), hold_gil)


def _frontier(stream: Any) -> int:
    """The node a capturing stream's next work will depend on: after a launch, that launch's kernel node."""
    result = check(cu.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
    deps = next(r for r in result if isinstance(r, list))  # (the result's fields differ between CUDA 12 and 13)
    assert len(deps) == 1, deps
    return int(deps[0])
