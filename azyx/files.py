"""Files read positionally: an open file checked against change at each read (`DiskFile`), a range of one that a
disk tensor is (`FileRange`), O_DIRECT reads past the page cache, and the element range a view of a file's tensor
covers. Storage logic below the devices: the disk device (azyx.backends.disk) and its load pipeline (azyx.loads) read
through it and count what they read; azyx.storage and azyx.io open files and name ranges with it."""

from __future__ import annotations

import errno
import os
import stat
import weakref
from typing import Any

import numpy as np

from azyx.errors import AzyxIOError
from azyx.graph import Shape, StridedView
from azyx.native import native

DIRECT_ALIGN = 4096  # O_DIRECT reads: offsets, lengths and memory aligned to this
IOV_MAX = 1024  # buffers per preadv call (Linux's limit)


class DiskFile:
    """One file opened read-only, shared by every buffer over its ranges and closed when the last of them goes.
    Reads go through this descriptor; each read is checked (`check`, before and after it), so a file replaced,
    truncated or rewritten since it was opened raises `AzyxIOError` rather than serving the old bytes (or a mix of
    old and new) to the tensors made from it; a file removed since still reads (the descriptor keeps its bytes)."""

    __slots__ = ("path", "where", "fd", "size", "identity", "header", "close", "direct", "__weakref__")

    def __init__(self, path: str):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise AzyxIOError(f"{path}: cannot open: {e.strerror or e}") from e
        self.fd, self.path = fd, path
        self.where = os.path.abspath(path)  # (what `check` stats: the same file after a chdir)
        # closed once unreachable, by a finalizer rather than __del__: a finalizer runs after the weak references are
        # cleared, so a cache of open files (weak values) can never hand out a file whose descriptor is closing
        self.close = weakref.finalize(self, os.close, fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise AzyxIOError(f"{path}: not a regular file")
        self.size = st.st_size
        self.identity = file_identity(st)
        self.header: Any = None  # what a format parser made of the file (azyx.io keeps its parsed header here)
        self.direct: int | None = -1  # the O_DIRECT descriptor (opened at the first direct read; None: refused)

    def __repr__(self) -> str:
        return f"DiskFile({self.path!r}, {self.size} bytes)"

    def check(self, what: str = "") -> None:
        """Raise `AzyxIOError` naming the file (and `what`, the data being read) where it is no longer the version
        opened: the open file truncated or rewritten in place (its size or modification time), or its path naming
        another file now (replaced). A file removed since is not a change: the descriptor keeps its bytes whole.
        Reads call it before and after each batch, so a load never hands out bytes of a file that changed while it
        loaded, nor the old bytes of one replaced."""
        now = file_identity(os.fstat(self.fd))
        if now == self.identity:
            try:
                named = file_identity(os.stat(self.where))
            except FileNotFoundError:
                return
            except OSError as e:
                raise AzyxIOError(f"{self._where(what)}: cannot stat it while it loads ({e.strerror or e})") from e
            if named[:2] == now[:2]:
                return
            why = "replaced by another file"
        elif now[2] < self.size:
            why = f"truncated to {now[2]} bytes"
        else:
            why = "rewritten"
        raise AzyxIOError(f"{self._where(what)}: {why} while it loaded (it had {self.size} bytes when opened): load "
                          f"it again")

    def _where(self, what: str) -> str:
        return f"{what} of {self.path}" if what else self.path

    def pread_into(self, offset: int, out: memoryview, what: str = "") -> None:
        """Fill `out` (a writable byte view) with the bytes at `offset`: positional reads, safe from any thread.
        `what` names the data (a tensor) in the error of a read that fails or finds the file shorter than it was."""
        done, n = 0, len(out)
        where = self._where(what)
        while done < n:
            try:
                got = _preadv(self.fd, out[done:], offset + done)
            except OSError as e:
                raise self._failed(where, n, offset, e) from e
            if got == 0:
                raise self._ended(where, offset + done, n, offset)
            done += got

    def _failed(self, where: str, n: int, offset: int, e: OSError) -> AzyxIOError:
        return AzyxIOError(f"{where}: read of {n} bytes at {offset} failed: {e.strerror or e}")

    def _ended(self, where: str, at: int, n: int, offset: int) -> AzyxIOError:
        return AzyxIOError(f"{where}: unexpected end of file at byte {at} while reading {n} bytes at {offset} (the "
                           f"file was truncated, or changed after it was opened: it had {self.size} bytes then)")

    def read_native(self, offset: int, runs: tuple[int, int] | None, start: int, outs: list[memoryview],
                    what: str = "", direct: np.ndarray | None = None) -> None:
        """`read_views` by the native core (azyx/csrc/read.c): the range's bytes from `start` on (a range of `runs`
        (run, step): the runs' bytes, packed) into `outs`, the file `check`ed before and after, in one call that holds
        the GIL only to begin and to end: a reader thread takes it once per extent, not once per system call, so the
        loop's thread does not wait for it behind many readers. With a `direct` block (aligned, DIRECT_ALIGN bytes at
        least) a plain range is read with O_DIRECT through it, where the filesystem allows it."""
        assert native is not None
        run, step = runs or (0, 0)
        n = sum(len(o) for o in outs)
        got = -2
        try:
            if direct is not None and runs is None and (dfd := self._direct_fd()) is not None:
                got = native.read_direct(dfd, offset + start, n, direct, outs, self.identity, self.where, self.fd)
                if got == -2:
                    self.direct = None  # refused after all (a filesystem that opens but will not read so)
            if got == -2:
                got = native.read_range(self.fd, offset, run, step, start, outs, self.identity, self.where)
        except OSError as e:
            raise self._failed(self._where(what), n, offset + start, e) from e
        end = start + max(got, 0)
        self._settle(got, n, what, offset + (end if run == 0 else end // run * step + end % run), offset + start)

    def _settle(self, got: int, n: int, what: str, at: int, offset: int) -> None:
        """Raise where a native read of `n` bytes at `offset` got `got`: -1, the file changed (`check` says how);
        fewer, it ended at byte `at`."""
        if got == -1:
            self.check(what)
            raise AzyxIOError(f"{self._where(what)}: changed while it loaded: load it again")
        if got < n:
            raise self._ended(self._where(what), at, n, offset)

    def read_direct(self, offset: int, nbytes: int, block: np.ndarray, what: str = "") -> np.ndarray | None:
        """`pread_direct`, the file `check`ed before and after (by the native core where it is built: the GIL released
        throughout); None where the filesystem refuses O_DIRECT (nothing read)."""
        if native is None:
            self.check(what)
            got = self.pread_direct(offset, nbytes, block, what)
            if got is not None:
                self.check(what)
            return got
        fd = self._direct_fd()
        if fd is None:
            return None
        lo, span = offset - offset % DIRECT_ALIGN, direct_span(offset, nbytes)
        assert block.nbytes >= span and block.ctypes.data % DIRECT_ALIGN == 0, "an unaligned O_DIRECT block"
        try:
            n = native.read_direct(fd, offset, nbytes, block[:span], None, self.identity, self.where, self.fd)
        except OSError as e:
            raise self._failed(f"{self._where(what)} (O_DIRECT)", nbytes, offset, e) from e
        if n == -2:
            self.direct = None
            return None
        self._settle(n, nbytes, what, offset + max(n, 0), offset)
        return block[offset - lo : offset - lo + nbytes]

    def pread_direct(self, offset: int, nbytes: int, block: np.ndarray, what: str = "") -> np.ndarray | None:
        """Bytes [offset, offset + nbytes) read with O_DIRECT (past the page cache) into `block` (uint8, aligned to
        DIRECT_ALIGN, at least `direct_span(offset, nbytes)` bytes), in aligned pieces; returns the view of `block` that
        holds them, or None where the platform or filesystem refuses O_DIRECT (then read them the usual way). `what`
        names the data in the error of a read that fails or finds the file shorter."""
        fd = self._direct_fd()
        if fd is None:
            return None
        lo = offset - offset % DIRECT_ALIGN
        span = direct_span(offset, nbytes)
        assert block.nbytes >= span and block.ctypes.data % DIRECT_ALIGN == 0, "an unaligned O_DIRECT block"
        view, done = block[:span].data, 0
        want = min(span, self.size - lo)  # (the last aligned piece may run past the end of the file)
        while done < want:
            try:
                got = os.preadv(fd, [view[done:]], lo + done)
            except OSError as e:
                if done == 0 and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    self.direct = None  # refused after all (a filesystem that opens but will not read so)
                    return None
                raise self._failed(f"{self._where(what)} (O_DIRECT)", nbytes, offset, e) from e
            if got == 0:
                break
            done += got
        if lo + done < offset + nbytes:
            raise self._ended(self._where(what), lo + done, nbytes, offset)
        return block[offset - lo : offset - lo + nbytes]

    def _direct_fd(self) -> int | None:
        if self.direct == -1:
            flag = getattr(os, "O_DIRECT", 0)
            try:
                fd = os.open(self.path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0)) if flag else None
            except OSError:
                fd = None
            if fd is not None and file_identity(os.fstat(fd)) != self.identity:  # (another file by now)
                os.close(fd)
                fd = None
            if fd is not None:
                weakref.finalize(self, os.close, fd)
            self.direct = fd
        return self.direct

    def pread_scatter(self, offset: int, outs: list[memoryview], what: str = "") -> None:
        """Fill the byte views `outs`, one after the other, with the bytes from `offset` on: one `preadv` call for
        them all (several tensors' destinations filled by one read), repeated where the kernel returns short."""
        outs = [o for o in outs if len(o)]
        where = self._where(what)
        while outs:
            if len(outs) == 1:
                return self.pread_into(offset, outs[0], what)
            n = sum(len(o) for o in outs)
            try:
                got = _preadv(self.fd, outs[:IOV_MAX], offset)
            except OSError as e:
                raise self._failed(where, n, offset, e) from e
            if got == 0:
                raise self._ended(where, offset, n, offset)
            offset += got
            while outs and got >= len(outs[0]):
                got -= len(outs[0])
                outs.pop(0)
            if got:
                outs[0] = outs[0][got:]

    def read_views(self, offset: int, outs: list[memoryview], what: str = "", direct: np.ndarray | None = None
                   ) -> None:
        """The bytes from `offset` on into the byte views `outs`, one after the other, with one `preadv` (an extent
        covering several tensors, each landing in its own destination), `check`ed before and after. With a `direct`
        block (`direct_block`, DIRECT_ALIGN bytes at least) they are read with O_DIRECT into it, a block at a time,
        and copied to `outs`, where the filesystem allows it."""
        n = sum(len(o) for o in outs)
        self.check(what)
        done = 0
        while direct is not None and done < n:
            lo = offset + done
            hi = min(offset + n, lo - lo % DIRECT_ALIGN + direct.nbytes)  # (the aligned span fits the block)
            got = self.pread_direct(lo, hi - lo, direct, what)
            if got is None:
                break
            _scatter(outs, done, got.data)
            done += hi - lo
        if done < n:
            self.pread_scatter(offset + done, _skip(outs, done), what)
        self.check(what)


def direct_span(offset: int, nbytes: int) -> int:
    """The bytes an O_DIRECT read of [offset, offset + nbytes) covers: whole DIRECT_ALIGN pieces."""
    lo = offset - offset % DIRECT_ALIGN
    return -(-(offset + nbytes - lo) // DIRECT_ALIGN) * DIRECT_ALIGN


def direct_block(nbytes: int) -> np.ndarray:
    """Host memory (uint8) aligned for O_DIRECT reads."""
    raw = np.empty(nbytes + DIRECT_ALIGN, np.uint8)
    at = (-raw.ctypes.data) % DIRECT_ALIGN
    return raw[at : at + nbytes]


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _preadv(fd: int, out: memoryview | list[memoryview], offset: int) -> int:
    try:
        outs = out if isinstance(out, list) else [out]
        if hasattr(os, "preadv"):
            return os.preadv(fd, outs, offset)
        data = os.pread(fd, sum(len(o) for o in outs), offset)  # platforms without preadv: one extra copy
        at = 0
        for o in outs:
            got = data[at : at + len(o)]
            o[: len(got)] = got
            at += len(got)
        return len(data)
    except InterruptedError:
        return _preadv(fd, out, offset)


class FileRange:
    """A disk Buffer's memory: `nbytes` bytes (the Buffer's) of `file`, starting at byte `offset`; `what` names the
    data for error messages (e.g. "tensor 'w'"). With `runs` (run, step) the bytes are runs of `run` bytes, one
    every `step` bytes of the file from `offset` on, packed one after the other (a slice of a row-major tensor
    along an inner axis: one device's columns; only those bytes are read)."""

    __slots__ = ("file", "offset", "what", "runs")

    def __init__(self, file: DiskFile, offset: int, what: str = "", runs: tuple[int, int] | None = None):
        self.file, self.offset, self.what, self.runs = file, offset, what, runs

    def __repr__(self) -> str:
        return f"FileRange({self.file.path!r}, offset={self.offset}{f', runs={self.runs}' if self.runs else ''})"

    def read_views(self, start: int, outs: list[memoryview], direct: np.ndarray | None = None) -> None:
        """The range's bytes from `start` on into the byte views `outs`, one after the other, the file `check`ed
        before and after: by the native core where it is built (`DiskFile.read_native`), else by
        `DiskFile.read_views` (one `preadv`; O_DIRECT through a `direct` block where given), run by run where the
        range is runs."""
        if native is not None:
            return self.file.read_native(self.offset, self.runs, start, outs, self.what, direct)
        if self.runs is None:
            return self.file.read_views(self.offset + start, outs, self.what, direct)
        self.file.check(self.what)
        for out in outs:
            self.read(start, out)
            start += len(out)
        self.file.check(self.what)

    def read(self, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of the range into `out` (unchecked: `read_views` checks)."""
        if self.runs is None:
            return self.file.pread_into(self.offset + start, out, self.what)
        run, step = self.runs
        done, n = 0, len(out)
        while done < n:
            i, within = divmod(start + done, run)
            size = min(run - within, n - done)
            self.file.pread_into(self.offset + i * step + within, out[done : done + size], self.what)
            done += size


def _skip(outs: list[memoryview], n: int) -> list[memoryview]:
    """The byte views `outs`, one after the other, less their first `n` bytes."""
    out = []
    for o in outs:
        if n >= len(o):
            n -= len(o)
        else:
            out.append(o[n:])
            n = 0
    return out


def _scatter(outs: list[memoryview], at: int, data: memoryview) -> None:
    """Write `data` into the byte views `outs`, taken one after the other, from byte `at` of them."""
    for o in _skip(outs, at):
        if not len(data):
            return
        k = min(len(o), len(data))
        o[:k] = data[:k]
        data = data[k:]


def covering(view: StridedView, shape: Shape) -> tuple[int, int]:
    """The element range [lo, hi) that `view` reads for `shape` (empty when the shape has no elements)."""
    if 0 in shape:
        return view.offset, view.offset
    lo = hi = view.offset
    for n, s in zip(shape, view.strides):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + 1
