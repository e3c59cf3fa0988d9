"""Optimisers whose step is lazy: `opt.step(grads)` rebinds every parameter handle (and every state tensor) to its
updated value with `Tensor.assign`, building graph nodes only. Realizing the loss, the parameters and the state
together runs forward, backward and update as ONE plan; since every iteration builds the same structure, the plan
cache hits from the second iteration on.

There is no `zero_grad`: gradients are not accumulated on the parameters, they are the lazy tensors that
`tape.gradient` returns, passed straight to `step`.

    with azyx.GradientTape() as tape:
        loss = nn.cross_entropy(model(x), y)
    opt.step(tape.gradient(loss, opt.params))
    await azyx.realize(loss, *opt.tensors())     # or: await azyx.realize(loss, *opt.step(...))

Every state tensor (moments, step powers) is a realized tensor from the start, so the first iteration's graph has
the same structure as every later one. Hyper-parameters are Python numbers, and numbers are data: each is a kernel
argument bound per run, so a learning rate that changes every step (`opt.lr = ...`, `LambdaLR`) reuses the same plan
and kernels. Only a change that alters the structure (a weight decay turned on or off) plans anew. Under `azyx.jit`
the hyper-parameters are read again on every replay (`azyx.traced.bound`): a schedule that changes `opt.lr` between
calls replays the same trace with the new rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from azyx.dtypes import dtypes
from azyx.errors import ArgumentError, DTypeError, ShapeError
from azyx.tensor import Tensor
from azyx.traced import bound


class Optimizer:
    """Holds the parameter handles and the state tensors; subclasses define `_update`."""

    def __init__(self, params: Sequence[Tensor], lr: float):
        self.params = list(params)
        if not self.params:
            raise ArgumentError("an optimiser needs at least one parameter")
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise DTypeError(f"parameter {i} is a {type(p).__name__}, not a Tensor")
            if not p.dtype.is_float:
                raise DTypeError(f"parameter {i} of shape {p.shape} is {p.dtype.name}; only float tensors train")
        if lr < 0:
            raise ArgumentError(f"learning rate must be >= 0, got {lr}")
        self.lr = lr
        self.state: list[Tensor] = []  # every state tensor, in a fixed order (realize them with the parameters)

    def _zeros_like(self, p: Tensor, *lead: int) -> Tensor:
        # realized from the start and placed like p, so the first step's graph has the structure of every later one
        t = p._placed_like(Tensor(np.zeros((*lead, *p.shape), p.dtype.numpy), dtype=p.dtype, device=p.device))
        self.state.append(t)
        return t

    def _scalar(self, value: float) -> Tensor:
        """A realized 0-d state tensor in the widest parameter dtype (at least float32)."""
        dt = max((p.dtype for p in self.params), key=lambda d: d.itemsize)
        dt = dt if dt.itemsize >= 4 else dtypes.float32
        p = self.params[0]
        t = p._placed_like(Tensor(np.asarray(value, dt.numpy), dtype=dt, device=p.device))
        self.state.append(t)
        return t

    def tensors(self) -> list[Tensor]:
        """The parameters, then the state: everything a step rebinds (realize them all, with the loss)."""
        return [*self.params, *self.state]

    def step(self, grads: Sequence[Tensor | None]) -> list[Tensor]:
        """Lazily update every parameter from its gradient (one per parameter, in order; None skips it) and rebind
        the parameter and state handles. Returns `tensors()` to realize."""
        grads = list(grads)
        if len(grads) != len(self.params):
            raise ArgumentError(f"step() got {len(grads)} gradients for {len(self.params)} parameters")
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None and g.shape != p.shape:
                raise ShapeError(f"gradient {i} has shape {g.shape}, its parameter {p.shape}")
        self._update([g.cast(p.dtype) if g is not None else None for p, g in zip(self.params, grads)])
        return self.tensors()

    def _update(self, grads: list[Tensor | None]) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum (PyTorch's form: buf = momentum * buf + g, no dampening),
    Nesterov momentum and L2 weight decay (added to the gradient).

    >>> import azyx
    >>> from azyx import Tensor, GradientTape, optim
    >>> w = Tensor([1.0, -2.0])
    >>> opt = optim.SGD([w], lr=0.1)
    >>> with GradientTape() as tape:
    ...     loss = (w * w).sum()
    >>> _ = opt.step(tape.gradient(loss, [w]))
    >>> w.numpy_sync().tolist()
    [0.800000011920929, -1.600000023841858]
    """

    def __init__(self, params: Sequence[Tensor], lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False):
        super().__init__(params, lr)
        if nesterov and momentum <= 0:
            raise ArgumentError("nesterov momentum needs momentum > 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.bufs = [self._zeros_like(p) for p in self.params] if momentum else []

    def _update(self, grads: list[Tensor | None]) -> None:
        lr, momentum, weight_decay = bound(self, "lr"), bound(self, "momentum"), bound(self, "weight_decay")
        decay, heavy = bool(weight_decay), bool(momentum)  # decided once (under azyx.jit: one guard each)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            if decay:
                g = g + p * weight_decay
            if heavy:
                buf = self.bufs[i].assign(self.bufs[i] * momentum + g)
                g = g + buf * momentum if self.nesterov else buf
            p.assign(p - g * lr)


class Adam(Optimizer):
    """Adam (Kingma & Ba) with PyTorch's bias correction; `weight_decay` is L2 added to the gradient. The step count
    lives on the device as running powers beta1**t and beta2**t, so every step has the same graph structure."""

    decoupled = False

    def __init__(self, params: Sequence[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ArgumentError(f"betas must be in [0, 1), got {betas}")
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.m = [self._zeros_like(p) for p in self.params]  # first moments
        self.v = [self._zeros_like(p) for p in self.params]  # second moments
        self.b1t, self.b2t = self._scalar(1.0), self._scalar(1.0)  # beta1**t, beta2**t

    def _update(self, grads: list[Tensor | None]) -> None:
        b1, b2, eps = bound(self, "b1"), bound(self, "b2"), bound(self, "eps")
        lr, weight_decay = bound(self, "lr"), bound(self, "weight_decay")
        c1, c2, decay = 1 - b1, 1 - b2, bool(weight_decay)  # once, not per parameter (under azyx.jit: fewer numbers)
        shrink = 1 - lr * weight_decay if decay and self.decoupled else 1.0
        b1t = self.b1t.assign(self.b1t * b1)
        b2t = self.b2t.assign(self.b2t * b2)
        scalars: dict[Any, tuple[Tensor, Tensor]] = {}  # per dtype: lr / (1 - beta1**t), 1 / (1 - beta2**t)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            if g is None:
                continue
            if decay and self.decoupled:
                p.assign(p * shrink)
            elif decay:
                g = g + p * weight_decay
            # g feeds both moments: the planner computes it once (a reduce below it is never recomputed per use)
            m.assign(m * b1 + g * c1)
            v.assign(v * b2 + g.square() * c2)
            if p.dtype not in scalars:
                scalars[p.dtype] = ((1 - b1t).cast(p.dtype).reciprocal() * lr,
                                    (1 - b2t).cast(p.dtype).reciprocal())
            step, inv_bc2 = scalars[p.dtype]
            p.assign(p - m * step / ((v * inv_bc2).sqrt() + eps))


class LambdaLR:
    """PyTorch's LambdaLR: the optimiser's learning rate is its initial one times `lr_lambda(epoch)`, set at
    construction (epoch 0) and by each `step()`. The rate is a scalar of the graph, a kernel argument: a new value every
    step builds no new plan and compiles nothing.

    >>> from azyx import Tensor, optim
    >>> opt = optim.SGD([Tensor([1.0])], lr=0.1)
    >>> sched = optim.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    >>> sched.step(); round(opt.lr, 6)
    0.05
    """

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float]):
        self.optimizer, self.lr_lambda = optimizer, lr_lambda
        self.base_lr = optimizer.lr
        self.last_epoch = 0
        optimizer.lr = self.base_lr * lr_lambda(0)

    def step(self) -> None:
        """Advance one epoch: the optimiser's `lr` becomes its initial rate times `lr_lambda(epoch)`. Compiles
        nothing."""
        self.last_epoch += 1
        self.optimizer.lr = self.base_lr * self.lr_lambda(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        """The optimiser's current learning rate, as a one-element list (PyTorch's form)."""
        return [self.optimizer.lr]


lr_scheduler = SimpleNamespace(LambdaLR=LambdaLR)  # as torch.optim.lr_scheduler


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): p *= 1 - lr * weight_decay before the Adam step."""

    decoupled = True

    def __init__(self, params: Sequence[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr, betas, eps, weight_decay)
