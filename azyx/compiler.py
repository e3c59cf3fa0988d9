"""A device's compiler part: source to artifact through one on-disk cache. A backend's `build` (see device.Device)
compiles a source on a worker thread through its `Compiler` (the device's `builder`): an artifact it keeps (a shared
library, SPIR-V, a cubin) goes through `cached_build` under `artifact_key` of what made it, a compiler that is a process
runs by `run_compiler` (in a process group of its own, killed at the device's compile_timeout_s), a failed build is
named one way (`Compiler.failed`), and what a compiler says about itself (its version, its predefined macros) is asked
once per compiler binary (`compiler_says`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from azyx.config import cache_dir
from azyx.errors import CompileError
from azyx.plan import KernelStep
from azyx.workers import lower_priority

T = TypeVar("T")


def kernel_list(names: list[str]) -> str:
    """Kernel names for a message: the first few, and how many in all."""
    shown = ", ".join(names[:4])
    return f"kernel {shown}" if len(names) == 1 else f"kernels {shown}" + (f" ({len(names)} in all)" if len(names) > 4
                                                                            else "")


class Compiler:
    """A device's compiler part (`Device.builder`), which its backend's `build` compiles through: an artifact by a
    compiler that is a process, from the disk cache or built there within the device's `compile_timeout_s`
    (`artifact`), kernels built one by one within that limit for all (`each`), and the one CompileError of a failed
    build (`failed`: the device, what failed, the kernels, the compiler's message, the source)."""

    def __init__(self, device: Any):
        self.device = device  # (its `name`, and its `compile_timeout_s` as it is at each build)

    def failed(self, what: str, names: list[str], err: BaseException | str, src: str,
               one: str | None = None) -> CompileError:
        """The error of a failed build: `what` failed ("OpenCL build", "creating the pipeline") of kernel `one` (of
        `names`), or of `names`, with the compiler's message `err` and the source."""
        of = kernel_list(names) if one is None else f"{kernel_list([one])} (of {kernel_list(names)})"
        return CompileError(f"{self.device.name}: {what} of {of} failed: {str(err) or type(err).__name__}\n"
                            f"--- source ---\n{src}")

    def artifact(self, kind: str, src: str, cmd: list[str], suffixes: tuple[str, str], names: list[str],
                 versions: Sequence[str] = (), check: Callable[[Path], None] | None = None,
                 timeout_s: float | None = None, what: str | None = None) -> Path:
        """`compiled`'s artifact of `src` by the compiler command `cmd` (under `kind` in the disk cache), killed at
        `timeout_s` (default: the device's compile_timeout_s); its CompileError names the device, the compiler and
        the kernels `names` (or `what`)."""
        what = f"{self.device.name}: {cmd[0]} compiling {what or kernel_list(names)}"
        limit = self.device.compile_timeout_s if timeout_s is None else timeout_s
        return compiled(kind, src, cmd, suffixes, what, limit, versions, check)

    def each(self, steps: list[KernelStep], build: Callable[[KernelStep, float], T], what: str,
             errors: tuple[type[BaseException], ...] = (Exception,)) -> dict[str, T]:
        """Per kernel of `steps`, what `build(step, seconds left)` makes of it, all within the device's
        compile_timeout_s; an error of `errors` that is no CompileError is the kernel's (`failed`: `what` failed)."""
        deadline = time.monotonic() + self.device.compile_timeout_s
        names = [s.name for s in steps]
        out = {}
        for step in steps:
            try:
                out[step.name] = build(step, max(deadline - time.monotonic(), 0.001))
            except CompileError:
                raise
            except errors as e:
                raise self.failed(what, names, e, step.src, step.name) from None
        return out


def artifact_key(*parts: str) -> str:
    """The disk cache's key of an artifact made from `parts` (the source, the compiler's version and flags)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def compiled(kind: str, src: str, cmd: list[str], suffixes: tuple[str, str], what: str, timeout_s: float,
             versions: Sequence[str] = (), check: Callable[[Path], None] | None = None) -> Path:
    """The artifact (suffixes[1]) of compiling `src` (written to a file of suffixes[0]) by the compiler command `cmd`,
    whose items "{src}" and "{out}" stand for the two files' paths: from the disk cache under the hash of the source,
    the command and the compiler's `versions`, else built there (`run_compiler`: killed at `timeout_s`), `check`ed
    (a validator run on the artifact) before it counts as built."""

    def build(tmp: Path) -> None:
        path = tmp.with_suffix(suffixes[0])  # the compiler's input, as private as its output
        try:
            path.write_text(src)
            run_compiler([{"{src}": str(path), "{out}": str(tmp)}.get(a, a) for a in cmd], what, timeout_s, src)
            if check is not None:
                check(tmp)
        finally:
            path.unlink(missing_ok=True)

    return cached_build(kind, artifact_key(src, *cmd, *versions), suffixes[1], build)


def cached_build(kind: str, key: str, suffix: str, build: Callable[[Path], None]) -> Path:
    """The path of a compiled artifact in the disk cache (`cache_dir()/kind/{key}{suffix}`), built first if absent.
    `build(tmp)` writes it to a temporary path private to this process and thread, which then replaces the final path
    atomically: concurrent builders (threads or processes) never collide, and a reader never sees half an artifact."""
    path = cache_dir() / kind / f"{key}{suffix}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            build(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def run_compiler(cmd: list[str], what: str, timeout_s: float, src: str) -> bytes:
    """Run a compiler (worker thread) in a process group of its own, so that at `timeout_s` (a device's
    compile_timeout_s) the whole group goes (a driver such as gcc runs cc1 and as as its children); raise CompileError
    on a timeout or a failure, naming `what` (the device and the kernels). Returns its standard output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lower_priority(proc.pid)  # (before a driver such as gcc starts its children, which inherit it)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CompileError(f"{what} took longer than compile_timeout_s={timeout_s:g} s; its process group was "
                           f"killed") from None
    finally:
        if proc.poll() is None:  # any other way out (an interrupt): no compiler is left behind
            _kill_group(proc)
    if proc.returncode != 0:
        raise CompileError(f"{what} failed (exit {proc.returncode}):\n{err.decode(errors='replace')}"
                           f"{out.decode(errors='replace')}\n--- source ---\n{src}")
    return out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a compiler's process group and reap it (its pipes close with the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a process that left the group holds the pipes: stop reading them
        proc.kill()
        proc.wait()


def compiler_says(kind: str, compiler: str, *args: str, key: Sequence[str] = ()) -> str:
    """What `compiler *args` prints (empty where it cannot run), kept in the disk cache (under `kind`) by the
    compiler's path, size and time of change and `key` (what else its answer depends on: the CPU, for
    -march=native): a process's start then runs no compiler before its first kernel's (tens of ms each)."""
    path = shutil.which(compiler)
    if path is None:
        return ""
    path = os.path.realpath(path)
    try:
        st = os.stat(path)
    except OSError:
        return ""

    def ask(tmp: Path) -> None:
        tmp.write_text(subprocess.run([compiler, *args], capture_output=True, text=True, timeout=30, check=True).stdout)

    try:
        return cached_build(kind, artifact_key(path, str(st.st_size), str(st.st_mtime_ns), *key, *args), ".txt",
                            ask).read_text()
    except (OSError, subprocess.SubprocessError):
        return ""
