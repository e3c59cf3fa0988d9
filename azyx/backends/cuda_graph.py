"""CUDA graphs of steady batches. A single-device plan's launches on a CUDA device are collected into one batch
(`CUDADevice.begin_batch`/`end_batch`); when a plan submits the same kernels on the same buffers again (the caching
allocator hands back the same blocks), the batch is captured once and then replays as one graph launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from azyx import debug
from azyx.backends.cuda_driver import check, cu, hot
from azyx.codegen.launch import Launch

GRAPH_AFTER = 2  # a batch seen this many times with the same buffers is captured into a CUDA graph
INLINE_LAUNCHES = 16  # a batch of more launches, not replayed as a graph, is submitted off the loop's thread (as is
# a batch's capture)
GRAPHS_KEPT = 256  # batches (graphs or sighting counts) remembered: plans that come and go keep the cache bounded

Collected = tuple[Any, Launch, tuple[int, ...], str]  # a batch's launch: function, dims, argument words, kernel name


class _Graph:
    """A captured batch: the executable graph and its handle for the launch path."""

    __slots__ = ("exe", "handle")

    def __init__(self, exe: Any):
        self.exe, self.handle = exe, int(exe)


class GraphCache:
    """One stream's graphs, by the launches they replay (kernel names, grids and pointers: one source may launch
    several grids); a batch not yet steady has a count of sightings instead."""

    def __init__(self, stream: Any, launch: Callable[[Any, Launch, tuple[int, ...], bool], None], name: str):
        self.stream, self.launch_one, self.name = stream, launch, name
        self.hot, self.stream_h = hot(), int(stream)
        self.graphs: dict[tuple, _Graph | int] = {}
        self.keyed: tuple[list[Collected], tuple] | None = None  # the last batch `cheap` keyed, and its key

    @staticmethod
    def key(batch: list[Collected]) -> tuple:
        # (the launch's fields, not the Launch: a dataclass's hash is Python code, a tuple of ints' is not)
        return tuple([(name, dims.grid, dims.group, dims.zero, ptrs) for _, dims, ptrs, name in batch])

    def cheap(self, batch: list[Collected]) -> bool:
        """Whether submitting the batch takes little time: one graph launch, or a few launches where this sighting
        does not capture the batch (a capture and its instantiation take milliseconds: the caller's submitter thread
        does it, never the loop's)."""
        if len(batch) == 1:
            return True
        key = self.key(batch)
        self.keyed = (batch, key)
        return self.cheap_keyed(key, len(batch))

    def cheap_keyed(self, key: tuple, launches: int) -> bool:
        """`cheap` for a batch of `launches` keyed by its caller (a frozen batch's key: `CUDADevice.launch_replay`)."""
        graph = self.graphs.get(key)
        if isinstance(graph, _Graph):
            return True
        return launches <= INLINE_LAUNCHES and (graph or 0) + 1 < GRAPH_AFTER

    def launch(self, batch: list[Collected] | Callable[[], list[Collected]], hold_gil: bool = True,
               key: tuple | None = None) -> None:
        """Under the device's lock: the batch's launches on the stream, one graph launch once the batch is steady.
        `hold_gil` False: each launch lets other threads run (a long batch submitted off the loop's thread). With
        `key` (a frozen batch's: its record and its table's bytes), `batch` is what makes its launches, called only
        where they are launched one by one or captured."""
        if key is None:
            assert isinstance(batch, list)
            if len(batch) == 1:
                fn, dims, ptrs, _ = batch[0]
                self.launch_one(fn, dims, ptrs, hold_gil)
                return
            keyed = self.keyed  # (once: the submitter thread's launch and the loop's `cheap` may interleave)
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
                graph = self.graphs[key] = self._capture(launches, hold_gil)
        if graph is not None and (err := (self.hot if hold_gil else self.hot.releasing).graph_launch(graph.handle,
                                                                                                    self.stream_h)):
            self.hot.fail(err, "cuGraphLaunch")
        if len(self.graphs) > GRAPHS_KEPT:
            self.graphs.pop(next(iter(self.graphs)))

    def _capture(self, batch: list[Collected], hold_gil: bool) -> _Graph:
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            for fn, dims, ptrs, _ in batch:
                self.launch_one(fn, dims, ptrs, hold_gil)
        finally:
            graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        exe = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        cu.cuGraphDestroy(graph)
        debug.log(debug.PLANS, f"{self.name}: captured {len(batch)} launches as a CUDA graph")
        return _Graph(exe)
