"""Movement ops against numpy (reshape permute transpose .T expand pad squeeze unsqueeze flatten flip repeat cat stack
split chunk), and ops on non-contiguous views: permuted, step-sliced, expanded, padded, chained, and views of realized
views. Basic and integer-tensor indexing and gather are in test_ops_nn.py."""

import itertools

import numpy as np
import pytest
from compare import assert_matches, sample

import azyx
from azyx import Tensor


def distinct(shape, dtype="float32"):
    """1, 2, 3, ... in `shape`: every element distinct and nonzero, so misplaced elements or padding show."""
    return (np.arange(int(np.prod(shape))) + 1).reshape(shape).astype(dtype)


# name, input shape, op on a Tensor, numpy reference
MOVEMENT = [
    ("reshape", (2, 3, 4), lambda t: t.reshape(6, 4), lambda x: x.reshape(6, 4)),
    ("reshape_-1_last", (2, 3, 4), lambda t: t.reshape(4, -1), lambda x: x.reshape(4, -1)),
    ("reshape_-1_mid", (2, 3, 4), lambda t: t.reshape(2, -1, 2), lambda x: x.reshape(2, -1, 2)),
    ("reshape_-1_flat", (2, 3, 4), lambda t: t.reshape(-1), lambda x: x.reshape(-1)),
    ("reshape_tuple", (2, 3, 4), lambda t: t.reshape((3, 8)), lambda x: x.reshape((3, 8))),
    ("reshape_unit_dims", (2, 3, 4), lambda t: t.reshape(1, 2, 1, 12), lambda x: x.reshape(1, 2, 1, 12)),
    ("reshape_0d_to_1", (), lambda t: t.reshape(1, 1), lambda x: x.reshape(1, 1)),
    ("reshape_to_0d", (1, 1), lambda t: t.reshape(()), lambda x: x.reshape(())),
    ("reshape_size0", (0, 6), lambda t: t.reshape(2, 0, 3), lambda x: x.reshape(2, 0, 3)),
    ("permute", (2, 3, 4), lambda t: t.permute(2, 0, 1), lambda x: x.transpose(2, 0, 1)),
    ("permute_negative", (2, 3, 4), lambda t: t.permute(-1, -3, -2), lambda x: x.transpose(2, 0, 1)),
    ("transpose_default", (2, 3, 4), lambda t: t.transpose(), lambda x: x.swapaxes(-2, -1)),
    ("transpose_0_2", (2, 3, 4), lambda t: t.transpose(0, 2), lambda x: x.swapaxes(0, 2)),
    ("T", (5, 3), lambda t: t.T, lambda x: x.T),
    ("expand", (3, 1), lambda t: t.expand(3, 4), lambda x: np.broadcast_to(x, (3, 4))),
    ("expand_new_dims", (3, 1), lambda t: t.expand(2, 3, 5), lambda x: np.broadcast_to(x, (2, 3, 5))),
    ("expand_0d", (), lambda t: t.expand(2, 3), lambda x: np.broadcast_to(x, (2, 3))),
    ("pad", (2, 3), lambda t: t.pad(((1, 2), (0, 3))), lambda x: np.pad(x, ((1, 2), (0, 3)))),
    (
        "pad_value",
        (2, 3, 2),
        lambda t: t.pad(((0, 1), (2, 0), (1, 1)), value=-1.5),
        lambda x: np.pad(x, ((0, 1), (2, 0), (1, 1)), constant_values=-1.5),
    ),
    ("pad_nothing", (2, 3), lambda t: t.pad(((0, 0), (0, 0))), lambda x: x),
    ("pad_rows_of_pairs", (4, 2), lambda t: t.pad(((1, 1), (0, 0))), lambda x: np.pad(x, ((1, 1), (0, 0)))),
    (
        "pad_every_axis_small",
        (2, 3, 2),
        lambda t: t.pad(((2, 1), (2, 1), (2, 1))),
        lambda x: np.pad(x, ((2, 1), (2, 1), (2, 1))),
    ),
    ("squeeze_all", (1, 3, 1, 4), lambda t: t.squeeze(), lambda x: x.squeeze()),
    ("squeeze_0", (1, 3, 1, 4), lambda t: t.squeeze(0), lambda x: x.squeeze(0)),
    ("squeeze_-2", (1, 3, 1, 4), lambda t: t.squeeze(-2), lambda x: x.squeeze(-2)),
    ("squeeze_non1_is_noop", (1, 3, 1, 4), lambda t: t.squeeze(1), lambda x: x),  # PyTorch semantics
    ("unsqueeze_0", (3, 4), lambda t: t.unsqueeze(0), lambda x: x[None]),
    ("unsqueeze_1", (3, 4), lambda t: t.unsqueeze(1), lambda x: x[:, None]),
    ("unsqueeze_-1", (3, 4), lambda t: t.unsqueeze(-1), lambda x: x[..., None]),
    ("unsqueeze_0d", (), lambda t: t.unsqueeze(0), lambda x: x.reshape(1)),
    ("flatten", (2, 3, 4), lambda t: t.flatten(), lambda x: x.reshape(-1)),
    ("flatten_1", (2, 3, 4), lambda t: t.flatten(1), lambda x: x.reshape(2, 12)),
    ("flatten_0_1", (2, 3, 4), lambda t: t.flatten(0, 1), lambda x: x.reshape(6, 4)),
    ("flatten_1_-1", (2, 3, 4, 2), lambda t: t.flatten(1, -1), lambda x: x.reshape(2, 24)),
    ("flip_0", (2, 3, 4), lambda t: t.flip(0), lambda x: np.flip(x, 0)),
    ("flip_-1", (2, 3, 4), lambda t: t.flip(-1), lambda x: np.flip(x, -1)),
    ("flip_tuple", (2, 3, 4), lambda t: t.flip((0, 2)), lambda x: np.flip(x, (0, 2))),
    ("repeat", (2, 3), lambda t: t.repeat(2, 3), lambda x: np.tile(x, (2, 3))),
    ("repeat_more_dims", (2, 3), lambda t: t.repeat(2, 1, 2), lambda x: np.tile(x, (2, 1, 2))),
    ("repeat_1d", (3,), lambda t: t.repeat(4), lambda x: np.tile(x, 4)),
    ("repeat_once", (2, 3), lambda t: t.repeat(1, 1), lambda x: x),
]


@pytest.mark.parametrize("name,shape,op,ref", MOVEMENT, ids=[m[0] for m in MOVEMENT])
def test_movement(device, name, shape, op, ref):
    x = distinct(shape)
    assert_matches(op(Tensor(x, device=device)), ref(x), dtype="float32")


@pytest.mark.parametrize("dtype", ["int32", "bool", "float16", "float64"])
@pytest.mark.parametrize("name", ["permute", "pad", "flip_tuple", "expand_new_dims", "repeat_more_dims"])
def test_movement_keeps_dtype(device, name, dtype):
    _, shape, op, ref = next(m for m in MOVEMENT if m[0] == name)
    x = distinct(shape, "int32") % 3 == 0 if dtype == "bool" else distinct(shape, dtype)
    assert_matches(op(Tensor(x, device=device)), ref(x), dtype=dtype)


def test_pad_value_on_int_tensor(device):
    x = distinct((2, 3), "int32")
    out = Tensor(x, device=device).pad(((1, 0), (2, 1)), value=7)
    assert_matches(out, np.pad(x, ((1, 0), (2, 1)), constant_values=7), dtype="int32")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cat(device, axis):
    rng = np.random.default_rng(0)
    shapes = {0: [(2, 3), (4, 3), (1, 3)], 1: [(2, 3), (2, 1), (2, 4)], -1: [(2, 2), (2, 5), (2, 1)]}[axis]
    xs = [sample(rng, s) for s in shapes]
    out = Tensor.cat([Tensor(x, device=device) for x in xs], axis=axis)
    assert_matches(out, np.concatenate(xs, axis=axis), dtype="float32")


def test_cat_with_empty_piece_single_piece_and_ints(device):
    a, empty = distinct((2, 3), "int32"), np.zeros((0, 3), np.int32)
    ta, te = Tensor(a, device=device), Tensor(empty, device=device)
    assert_matches(Tensor.cat([ta, te, ta], axis=0), np.concatenate([a, empty, a]), dtype="int32")
    assert_matches(Tensor.cat([ta], axis=1), a, dtype="int32")


@pytest.mark.parametrize("axis", [0, 1, -1, 2])
def test_stack(device, axis):
    xs = [sample(np.random.default_rng(i), (2, 3)) for i in range(3)]
    out = Tensor.stack([Tensor(x, device=device) for x in xs], axis=axis)
    assert_matches(out, np.stack(xs, axis=axis), dtype="float32")


def sections(length, size):
    return [(i, min(i + size, length)) for i in range(0, length, size)]


@pytest.mark.parametrize("shape,size,axis", [((5, 3), 2, 0), ((3, 5), 2, 1), ((5, 3), 5, 0), ((4, 6), 3, -1)], ids=str)
def test_split(device, shape, size, axis):
    x = distinct(shape)
    parts = Tensor(x, device=device).split(size, axis=axis)
    bounds = sections(x.shape[axis], size)
    assert len(parts) == len(bounds)
    for part, (lo, hi) in zip(parts, bounds, strict=True):
        assert_matches(part, np.take(x, np.arange(lo, hi), axis=axis), dtype="float32")


@pytest.mark.parametrize("shape,n,axis", [((5, 2), 3, 0), ((6, 2), 4, 0), ((6, 2), 3, 0), ((2, 7), 2, -1)], ids=str)
def test_chunk(device, shape, n, axis):
    # PyTorch: chunks of ceil(len / n); fewer than n chunks when that covers the axis sooner (6 in 4 -> 3 chunks of 2)
    x = distinct(shape)
    chunks = Tensor(x, device=device).chunk(n, axis=axis)
    bounds = sections(x.shape[axis], -(-x.shape[axis] // n))
    assert len(chunks) == len(bounds)
    for chunk, (lo, hi) in zip(chunks, bounds, strict=True):
        assert_matches(chunk, np.take(x, np.arange(lo, hi), axis=axis), dtype="float32")


async def test_split_parts_realized_in_one_plan(device):
    x = distinct((7, 2))
    parts = Tensor(x, device=device).split(3)
    await azyx.realize(*parts)
    for got, want in zip(parts, np.split(x, [3, 6]), strict=True):
        np.testing.assert_array_equal(await got.numpy(), want)


@pytest.mark.parametrize("shape", [(4, 2), (5, 2), (7, 2), (9, 2), (3, 3), (2, 5)], ids=str)
def test_pad_small_shapes(device, shape):
    # narrow rows (width 2) padded along the outer axis have tripped index simplification
    x = distinct(shape)
    failures = []
    for pads in itertools.product([(1, 1), (1, 2), (2, 0), (3, 1)], [(0, 0), (1, 0)]):
        out, ref = Tensor(x, device=device).pad(pads).numpy_sync(), np.pad(x, pads)
        if out.shape != ref.shape or not np.array_equal(out, ref):
            failures.append(f"pads {pads}: got {out.tolist()}, want {ref.tolist()}")
    assert not failures, "\n".join(failures)


# Two movement ops in a row on small 2-D shapes: few elements, but every index expression meets edge cases
# (dims of 1 and 2, pads at both ends, reversed and strided axes). numpy twins apply the same op.
SMALL_OPS = {
    "flip0": (lambda t: t.flip(0), lambda x: np.flip(x, 0)),
    "flip1": (lambda t: t.flip(1), lambda x: np.flip(x, 1)),
    "pad0": (lambda t: t.pad(((1, 2), (0, 0))), lambda x: np.pad(x, ((1, 2), (0, 0)))),
    "pad1": (lambda t: t.pad(((0, 0), (2, 1)), value=-1.0), lambda x: np.pad(x, ((0, 0), (2, 1)), constant_values=-1)),
    "T": (lambda t: t.T, lambda x: x.T),
    "step2": (lambda t: t[::2], lambda x: x[::2]),
    "rev1": (lambda t: t[:, ::-1], lambda x: x[:, ::-1]),
    "shrink": (lambda t: t[1:], lambda x: x[1:]),
    "reshape": (lambda t: t.reshape(t.shape[1], t.shape[0]), lambda x: x.reshape(x.shape[1], x.shape[0])),
}


@pytest.mark.parametrize("shape", [(4, 2), (3, 2), (2, 3), (2, 2), (5, 3)], ids=str)
def test_pairs_of_movement_ops_on_small_shapes(device, shape):
    x = distinct(shape)
    failures = []
    for (n1, (op1, ref1)), (n2, (op2, ref2)) in itertools.product(SMALL_OPS.items(), repeat=2):
        ref = ref2(ref1(x))
        try:
            out = op2(op1(Tensor(x, device=device))).numpy_sync()
        except azyx.AzyxError as e:
            failures.append(f"{n1}.{n2}: {e}")
            continue
        if out.shape != ref.shape or not np.array_equal(out, ref):
            failures.append(f"{n1}.{n2}: got {out.tolist()}, want {ref.tolist()}")
    assert not failures, f"{len(failures)} of {len(SMALL_OPS) ** 2} pairs wrong:\n" + "\n".join(failures)


# ---- ops on non-contiguous views --------------------------------------------------------------------------------

X_SHAPE = (4, 6, 5)

# name, op on a Tensor of shape X_SHAPE, numpy reference
VIEW_CASES = [
    (
        "permuted_times_broadcast_reduce",
        lambda t: t.permute(2, 0, 1) * t.sum(axis=1).T[:, :, None],
        lambda x: x.transpose(2, 0, 1) * x.sum(axis=1).T[:, :, None],
    ),
    ("step_sliced", lambda t: t[::2, 1::2, ::-1] + 1.0, lambda x: x[::2, 1::2, ::-1] + 1.0),
    ("expanded", lambda t: t[:, :1, :].expand(4, 6, 5) * t, lambda x: x[:, :1, :] * x),
    (
        "padded_then_unary",
        lambda t: t.pad(((1, 0), (0, 2), (1, 1)), value=0.5).exp(),
        lambda x: np.exp(np.pad(x, ((1, 0), (0, 2), (1, 1)), constant_values=0.5)),
    ),
    ("reshape_of_permuted", lambda t: t.permute(1, 0, 2).reshape(6, 20), lambda x: x.transpose(1, 0, 2).reshape(6, 20)),
    ("reshape_of_transposed_2d", lambda t: t.reshape(24, 5).T.reshape(-1), lambda x: x.reshape(24, 5).T.reshape(-1)),
    (
        "reshape_of_padded",
        lambda t: t.pad(((0, 0), (1, 1), (0, 0))).reshape(4, 40),
        lambda x: np.pad(x, ((0, 0), (1, 1), (0, 0))).reshape(4, 40),
    ),
    (
        "reshape_of_flipped_then_permute",
        lambda t: t.flip(1).reshape(2, 2, 30).permute(2, 0, 1),
        lambda x: np.flip(x, 1).reshape(2, 2, 30).transpose(2, 0, 1),
    ),
    (
        "expand_then_reshape",
        lambda t: t[:, :1, :].expand(4, 3, 5).reshape(12, 5),
        lambda x: np.broadcast_to(x[:, :1, :], (4, 3, 5)).reshape(12, 5),
    ),
    (
        "chain_of_views",
        lambda t: t.reshape(24, 5).T[1:, ::3].pad(((1, 0), (0, 1)), value=2.0).flip(0) * 2.0,
        lambda x: np.flip(np.pad(x.reshape(24, 5).T[1:, ::3], ((1, 0), (0, 1)), constant_values=2.0), 0) * 2.0,
    ),
    ("two_views_of_one_tensor", lambda t: t + t.flip(0), lambda x: x + np.flip(x, 0)),
    (
        "permuted_times_sliced_permuted",
        lambda t: t.permute(1, 0, 2)[::2] * t[:, 1::2].permute(1, 0, 2),
        lambda x: x.transpose(1, 0, 2)[::2] * x[:, 1::2].transpose(1, 0, 2),
    ),
    ("repeat_of_slice", lambda t: t[1:3, ::-2].repeat(2, 1, 2), lambda x: np.tile(x[1:3, ::-2], (2, 1, 2))),
    (
        "cat_of_views",
        lambda t: Tensor.cat([t[0].T, t[1].T[:, ::-1]], axis=1),
        lambda x: np.concatenate([x[0].T, x[1].T[:, ::-1]], axis=1),
    ),
    ("sum_over_permuted", lambda t: t.permute(2, 0, 1).sum(axis=1), lambda x: x.transpose(2, 0, 1).sum(axis=1)),
    ("sum_over_expanded", lambda t: t[:, :1, :].expand(4, 6, 5).sum(axis=1), lambda x: 6 * x[:, 0, :]),
    (
        "sum_over_padded",
        lambda t: t.pad(((1, 1), (0, 0), (2, 0)), value=0.5).sum(axis=(0, 2)),
        lambda x: np.pad(x, ((1, 1), (0, 0), (2, 0)), constant_values=0.5).sum(axis=(0, 2)),
    ),
    ("max_over_step_sliced", lambda t: t[::-1, ::2].max(axis=0), lambda x: x[::-1, ::2].max(axis=0)),
]


@pytest.mark.parametrize("name,op,ref", VIEW_CASES, ids=[v[0] for v in VIEW_CASES])
def test_ops_on_views(device, name, op, ref):
    x = sample(np.random.default_rng(1), X_SHAPE)
    assert_matches(op(Tensor(x, device=device)), ref(x.astype(np.float64)), dtype="float32", rtol=1e-5, atol=1e-5)


def test_argmax_over_reversed_view_keeps_first_index_of_the_view(device):
    x = np.random.default_rng(2).integers(0, 3, size=(5, 8)).astype(np.float32)
    t = Tensor(x, device=device)
    assert_matches(t[:, ::-1].argmax(axis=1), np.argmax(x[:, ::-1], axis=1))
    assert_matches(t.T[::-1].argmin(axis=0), np.argmin(x.T[::-1], axis=0))


def test_view_of_realized_view(device):
    x = distinct((6, 4))
    base = Tensor(x, device=device)
    view = base.T[:, ::2]
    view.realize_sync()
    np.testing.assert_array_equal(view.numpy_sync(), x.T[:, ::2])
    again = view.reshape(-1)[1:].flip(0) * 3.0
    assert_matches(again, np.flip(x.T[:, ::2].reshape(-1)[1:], 0) * 3.0, dtype="float32")
    assert_matches(view.permute(1, 0) + base[::2], x.T[:, ::2].T + x[::2], dtype="float32")
    assert_matches(base, x, dtype="float32")  # the source is untouched


def test_realized_view_used_by_two_later_graphs(device):
    x = sample(np.random.default_rng(3), (5, 7))
    v = Tensor(x, device=device)[1:, ::-1].pad(((0, 1), (1, 0)))
    v.realize_sync()
    xv = np.pad(x[1:, ::-1], ((0, 1), (1, 0)))
    a, b = v.T.exp(), (v * v).sum(axis=0)
    assert_matches(b, (xv.astype(np.float64) ** 2).sum(axis=0), dtype="float32")
    assert_matches(a, np.exp(xv.T.astype(np.float64)), dtype="float32")
