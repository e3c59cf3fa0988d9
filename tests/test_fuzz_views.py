"""Random compositions of movement ops, fused with elementwise and reduce ops, against numpy.

Index arithmetic (and the compiler under it) is where silent wrong answers hide; this walks many
compositions deterministically (derandomized hypothesis) so that a failure reproduces.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from azyx import Tensor


@st.composite
def chains(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    x = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)
    ops: list[tuple] = []
    cur = shape
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["permute", "flip", "pad", "reshape", "expand", "slice", "realize"]))
        nd = len(cur)
        if kind == "permute":
            ops.append(("permute", tuple(draw(st.permutations(range(nd))))))
        elif kind == "flip":
            ops.append(("flip", draw(st.integers(0, nd - 1))))
        elif kind == "pad":
            pads = tuple((draw(st.integers(-min(1, s - 1), 2)), draw(st.integers(-min(1, s - 1), 2))) for s in cur)
            pads = tuple((b, a) if s + b + a > 0 else (0, 0) for (b, a), s in zip(pads, cur))
            ops.append(("pad", pads))
            cur = tuple(s + b + a for s, (b, a) in zip(cur, pads))
            continue
        elif kind == "reshape":
            total = int(np.prod(cur))
            divisors = [d for d in range(1, total + 1) if total % d == 0]
            a = draw(st.sampled_from(divisors))
            new = (a, total // a) if draw(st.booleans()) else (total,)
            ops.append(("reshape", new))
            cur = new
            continue
        elif kind == "expand":
            ax = draw(st.integers(0, nd))
            new = cur[:ax] + (draw(st.integers(2, 3)),) + cur[ax:]
            ops.append(("expand", ax, new))
            cur = new
            continue
        elif kind == "slice":
            ax = draw(st.integers(0, nd - 1))
            step = draw(st.sampled_from([2, -1, -2, 3]))
            ops.append(("slice", ax, step))
            cur = tuple(len(range(*slice(None, None, step).indices(s))) if i == ax else s for i, s in enumerate(cur))
            continue
        else:
            ops.append(("realize",))
            continue
        if kind == "permute":
            cur = tuple(cur[p] for p in ops[-1][1])
    tail = draw(st.sampled_from(["none", "elementwise", "sum", "max_keepdim"]))
    ops.append((tail,))
    return x, ops


def apply(x: object, ops: list[tuple], is_np: bool) -> object:
    for op in ops:
        k = op[0]
        if k == "permute":
            x = np.transpose(x, op[1]) if is_np else x.permute(*op[1])  # type: ignore[attr-defined]
        elif k == "flip":
            x = np.flip(x, op[1]) if is_np else x.flip(op[1])  # type: ignore[attr-defined]
        elif k == "pad":
            if is_np:
                arr = np.asarray(x)
                sl = tuple(slice(-b if b < 0 else 0, s + a if a < 0 else s) for (b, a), s in zip(op[1], arr.shape))
                arr = arr[sl]
                x = np.pad(arr, tuple((max(b, 0), max(a, 0)) for b, a in op[1]), constant_values=-7.0)
            else:
                x = x.pad(op[1], value=-7.0)  # type: ignore[attr-defined]
        elif k == "reshape":
            x = np.reshape(x, op[1]) if is_np else x.reshape(*op[1])  # type: ignore[attr-defined]
        elif k == "expand":
            _, ax, new = op
            if is_np:
                x = np.broadcast_to(np.expand_dims(x, ax), new)
            else:
                x = x.unsqueeze(ax).expand(*new)  # type: ignore[attr-defined]
        elif k == "slice":
            _, ax, step = op
            key = tuple(slice(None, None, step) if i == ax else slice(None) for i in range(np.ndim(x) if is_np
                                                                                        else x.ndim))  # type: ignore
            x = x[key]  # type: ignore[index]
        elif k == "realize":
            if not is_np:
                x = x.realize_sync()  # type: ignore[attr-defined]
        elif k == "elementwise":
            x = x * 2 + 1  # type: ignore[operator]
        elif k == "sum":
            x = x.sum(axis=0) if is_np else x.sum(axis=0)  # type: ignore[attr-defined]
        elif k == "max_keepdim":
            x = x.max(axis=-1, keepdims=True) if is_np else x.max(axis=-1, keepdim=True)  # type: ignore[attr-defined]
    return x


@settings(max_examples=300, deadline=None, derandomize=True)
@given(chains())
def test_random_view_chains_match_numpy(case: tuple[np.ndarray, list[tuple]]) -> None:
    x, ops = case
    ref = np.asarray(apply(x, ops, True))
    out = apply(Tensor(x, device="c:0"), ops, False).numpy_sync()  # type: ignore[attr-defined]
    assert out.shape == ref.shape, ops
    np.testing.assert_allclose(out, ref, rtol=1e-6, err_msg=str(ops))
