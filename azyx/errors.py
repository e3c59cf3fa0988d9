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


class AllocationError(AzyxError, MemoryError):
    """A plan's buffers do not fit in any device's free memory."""


class CompileError(AzyxError, RuntimeError):
    """A device compiler rejected generated code; the message carries the compiler's output."""


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
