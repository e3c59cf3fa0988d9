"""Saving tensors to a safetensors file, atomically.

The file is written as a temporary file beside the destination (same directory, so the rename stays on one file
system), flushed and fsynced, then renamed over the destination with `os.replace`, and the directory is fsynced:
a crash or an error mid-save leaves either the old file or no file under the final name, never a truncated one.
Lazy tensors are realized first (one plan); then each tensor's bytes are copied from its device and written on a
worker thread, one tensor at a time, so the host memory used is about the largest tensor.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np

from azyx.device import Buffer
from azyx.dtypes import DType, dtypes
from azyx.errors import AzyxIOError, DTypeError
from azyx.fileformat import DTYPES, SafetensorsError, TensorEntry, header_bytes
from azyx.graph import GRAPH, Shape, StridedView, prod
from azyx.realize import realize
from azyx.tensor import Tensor
from azyx.workers import in_background, in_worker_thread, result_of, start_in_worker_thread


async def save_safetensors(path: Any, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None
                           ) -> None:
    """Write `tensors` (name -> Tensor, on any devices, lazy or not) to a safetensors file at `path`, readable by
    the `safetensors` package; `metadata` becomes the header's `__metadata__`. Atomic: on any failure the previous
    file (or no file) stays under `path`.

    >>> import asyncio, numpy as np, azyx
    >>> from safetensors.numpy import load_file
    >>> x = azyx.Tensor(np.arange(4, dtype=np.float32))
    >>> asyncio.run(azyx.io.save_safetensors("/tmp/azyx_doc4.safetensors", {"x2": x * 2}))
    >>> load_file("/tmp/azyx_doc4.safetensors")["x2"].tolist()
    [0.0, 2.0, 4.0, 6.0]
    """
    try:
        p = os.fspath(path)
    except TypeError:
        raise AzyxIOError(f"a safetensors path must be a str or os.PathLike, got {path!r}") from None
    if not isinstance(tensors, Mapping):
        raise SafetensorsError(p, f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(p, f"tensor names must be strings other than '__metadata__', got {name!r}")
        if not isinstance(t, Tensor):
            raise SafetensorsError(p, f"{name!r} is a {type(t).__name__}, not an azyx Tensor")
        if t.dtype.safetensors not in DTYPES:
            raise DTypeError(f"{p}: tensor {name!r} has dtype {t.dtype.name}, which safetensors files do not hold")
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise SafetensorsError(p, f"metadata must map strings to strings, got {metadata!r}")

    items = list(tensors.items())
    await realize(*(t for _, t in items))  # computes what is lazy (one plan) and waits for what is queued
    # widest dtype first (then the given order), like the reference writer: every tensor stays aligned to its item
    items.sort(key=lambda kv: -kv[1].dtype.itemsize)
    entries, pos = [], 0
    for name, t in items:
        n = prod(t.shape) * t.dtype.itemsize
        entries.append(TensorEntry(name, t.dtype, t.shape, pos, pos + n))
        pos += n
    head = header_bytes(entries, dict(metadata) if metadata else None)

    opening = start_in_worker_thread(AtomicWriter, p)
    try:
        writer = await result_of(opening)
    except BaseException:  # cancelled while the temporary file is being created: remove it once it exists
        opening.add_done_callback(_abort_opened)
        raise
    committed = False
    try:
        await in_worker_thread(writer.write, head)
        for _, t in items:
            node = GRAPH[t.id]
            data = await in_worker_thread(_raw_bytes, node.buffer, node.view, node.shape, node.dtype)
            await in_worker_thread(writer.write, data)
            del data
        await in_worker_thread(writer.commit)
        committed = True
    finally:
        if not committed:
            writer.abort_soon()


def _abort_opened(opening: Future[AtomicWriter]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        in_background(opening.result().abort)


def _raw_bytes(buf: Buffer | None, view: StridedView | None, shape: Shape, dtype: DType) -> memoryview:
    """A realized tensor's bytes in its storage format (bfloat16 as its 16 bits), row-major; on a worker thread."""
    assert buf is not None and view is not None
    if buf.device.host_memory and view.is_contiguous(shape):  # no copy: straight from the device's memory
        mem: np.ndarray = buf.mem
        return mem.reshape(-1).view(np.uint8)[: prod(shape) * dtype.itemsize].data
    raw_dtype = dtypes.int16 if dtype is dtypes.bfloat16 else dtype  # the bits, not a widened float32
    arr = buf.device.read(buf, view, shape, raw_dtype)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data


class AtomicWriter:
    """A temporary file beside `path`; `commit` moves it into place, `abort` removes it. Thread-safe: an abort
    waits for a write under way, then nothing more is written."""

    def __init__(self, path: str):
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        base = os.path.basename(path)
        if not base:
            raise AzyxIOError(f"{path}: not a file name")
        self.lock = threading.Lock()
        self.done = False
        while True:
            self.tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
            try:  # 0o666 less the umask, like a file the safetensors package would create
                self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                                  0o666)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise AzyxIOError(f"{path}: cannot create a temporary file in {directory}: {e.strerror or e}"
                                  ) from e

    def write(self, data: bytes | memoryview) -> None:
        with self.lock:
            if self.done:
                raise AzyxIOError(f"{self.path}: the save was abandoned")
            view = memoryview(data).cast("B")
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as e:
                raise AzyxIOError(f"{self.path}: write failed: {e.strerror or e}") from e

    def commit(self) -> None:
        with self.lock:
            if self.done:
                raise AzyxIOError(f"{self.path}: the save was abandoned")
            try:
                os.fsync(self.fd)
                os.close(self.fd)
                self.done = True
                os.replace(self.tmp, self.path)
            except OSError as e:
                self._remove()
                raise AzyxIOError(f"{self.path}: cannot complete the save: {e.strerror or e}") from e
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        with self.lock:
            self._remove()

    def abort_soon(self) -> None:
        """Abort now if no write is under way (the usual error path), else right after it, on a worker thread."""
        if self.lock.acquire(blocking=False):
            try:
                self._remove()
            finally:
                self.lock.release()
        else:
            in_background(self.abort)

    def _remove(self) -> None:
        if not self.done:
            self.done = True
            try:
                os.close(self.fd)
            except OSError:
                pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (where directories can be opened: POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
