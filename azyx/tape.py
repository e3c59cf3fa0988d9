"""GradientTape: records the nodes built inside its `with` block; while the tape object is alive, those nodes
keep their sources even after they are realized, so `tape.gradient` can walk them (the walk is autograd.py)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, overload

from azyx.autograd import gradient
from azyx.errors import RuntimeStateError
from azyx.graph import GRAPH
from azyx.tensor import Tensor


class GradientTape:
    """Record the ops built inside `with GradientTape() as tape:`; `tape.gradient(target, sources)` returns lazy
    gradient tensors made of the same ops, so they fuse and plan like any other tensor.

    >>> import azyx
    >>> from azyx import GradientTape, Tensor
    >>> x = Tensor([1.0, 2.0, 3.0])
    >>> with GradientTape() as tape:
    ...     y = (x * x).sum()
    >>> tape.gradient(y, x).numpy_sync().tolist()
    [2.0, 4.0, 6.0]

    - A non-persistent tape answers one `gradient` call and then releases what it kept; a second call raises
      `azyx.RuntimeStateError`. `GradientTape(persistent=True)` answers any number of calls until it is dropped.
    - Dropping the tape lets realized nodes it kept forget their sources, so the graph shrinks back.
    - Tapes nest: gradient ops built inside an outer tape's block are recorded by it (higher-order gradients).
    - Only ops recorded by this tape are differentiated; anything built outside it (parameters, data) is a
      constant or, when listed in `sources`, a source.
    """

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self.ids: set[int] = set()  # ids of the live nodes it recorded (a freed id leaves the set: graph.py)
        self.used = False
        GRAPH.add_tape(self.ids)
        self._release = weakref.finalize(self, GRAPH.drop_tape, self.ids)
        self._release.atexit = False

    def __enter__(self) -> GradientTape:
        if self.used:
            raise RuntimeStateError("this non-persistent GradientTape was already used by gradient(); make a new one")
        GRAPH.recording = [*GRAPH.recording, self.ids]
        return self

    def __exit__(self, *exc: object) -> None:
        GRAPH.recording = [s for s in GRAPH.recording if s is not self.ids]

    def watched(self, t: Tensor) -> bool:
        """Whether `t`'s node was recorded by this tape (and is still alive)."""
        return t.id in self.ids

    @overload
    def gradient(self, target: Tensor, sources: Tensor, seed: Any = None) -> Tensor: ...

    @overload
    def gradient(self, target: Tensor, sources: Sequence[Tensor], seed: Any = None) -> list[Tensor]: ...

    def gradient(self, target: Tensor, sources: Tensor | Sequence[Tensor], seed: Any = None) -> Tensor | list[Tensor]:
        """d target / d source for each source, as lazy tensors (one per source, in order; a single Tensor for a
        single source). `target` must be a float tensor; a non-scalar target needs `seed` (the upstream gradient,
        of the target's shape): the result is then the vector-Jacobian product. A source the target does not
        depend on through recorded ops gets zeros of its shape and dtype.

        >>> from azyx import GradientTape, Tensor
        >>> w = Tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> with GradientTape() as tape:
        ...     y = w @ w
        >>> tape.gradient(y, w, seed=Tensor.ones(2, 2)).numpy_sync().tolist()
        [[7.0, 11.0], [9.0, 13.0]]
        """
        if self.used:
            raise RuntimeStateError("gradient() was already called on this non-persistent GradientTape; use "
                                    "GradientTape(persistent=True) to call it several times")
        single = isinstance(sources, Tensor)
        srcs: list[Tensor] = [sources] if isinstance(sources, Tensor) else list(sources)
        grads = gradient(self.ids, target, srcs, seed)
        if not self.persistent:
            self.used = True
            self._release()  # the lazy gradients hold (by refcount) every node they still need
        return grads[0] if single else grads

    def release(self) -> None:
        """Let go of what the tape kept now, instead of when it is dropped; no more gradient() calls."""
        self.used = True
        self._release()
