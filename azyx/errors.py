"""The exceptions azyx raises for bad user input. Broken internal invariants are AssertionErrors (bugs)."""


class AzyxError(Exception):
    """Base of every error caused by the caller's input or environment."""


class ShapeError(AzyxError, ValueError):
    """Shapes that do not fit the operation (broadcasting, reshape, axes, pads, matmul dims)."""


class AxisError(ShapeError, IndexError):
    """An axis outside the tensor's dimensions."""


class IndexOutOfRange(AzyxError, IndexError):
    """An index outside a dimension."""


class DTypeError(AzyxError, TypeError):
    """An unknown dtype, or one the operation does not accept."""


class DeviceError(AzyxError, ValueError):
    """An unknown or unavailable device, or devices that cannot be mixed."""


class DeviceFailedError(DeviceError):
    """A device that has failed (a kernel faulted, the driver lost the device): every wait on its work, and every
    new use of it, raises this, naming the device and the cause. Other devices keep working."""


class AllocationError(AzyxError, MemoryError):
    """A plan's buffers do not fit in any device's free memory, or a device refused an allocation (the message names
    the device and the bytes requested)."""


class CompileError(AzyxError, RuntimeError):
    """A device compiler rejected generated code (the message carries the compiler's output) or ran past the
    configured `compile_timeout_s` (the message names the device, the kernels and the limit)."""


class AzyxIOError(AzyxError, OSError):
    """A file that cannot be read or written, or is malformed."""


class RuntimeStateError(AzyxError, RuntimeError):
    """A call made in the wrong state (e.g. a synchronous call inside a running event loop)."""


class ArgumentError(AzyxError, ValueError):
    """An argument outside its allowed values (a probability, a learning rate, a reduction name)."""


class StateDictError(AzyxError, KeyError):
    """A state dict with missing or unexpected keys (the message names them)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class LazyChainWarning(UserWarning):
    """A lazy chain that grows across realizes without being realized (an optimiser step whose result is never
    realized): each realize plans, compiles and computes the whole chain again."""


def fresh_copy(err: BaseException) -> BaseException:
    """A new exception like `err` (type, message, attributes, cause), without its traceback: what a failure kept for
    several waiters is raised as, so that no waiter's frames (and the tensors they hold) stay alive with the kept
    one, and no waiter's traceback grows another's."""
    new = type(err).__new__(type(err), *err.args)
    new.args = err.args
    new.__dict__.update(vars(err))
    new.__cause__ = err.__cause__
    return new


def kept(err: BaseException) -> BaseException:
    """`err` to keep for later waiters: the tracebacks of it and of its causes dropped (their frames would keep the
    failed work's buffers alive). Returns `err`."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return err
