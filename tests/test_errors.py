"""Bad user input raises an `azyx.AzyxError` subclass at the call that received it (never later, at realize), the
message names the offending value, and the runtime keeps working afterwards."""

import numpy as np
import pytest

import azyx
from azyx import Tensor


def shape_text(shape):
    """The ways a message may spell a shape: (3, 4), [3, 4] or 3x4."""
    return (str(tuple(shape)), str(list(shape)), "x".join(map(str, shape)))


def zeros(device, *shape, dtype="float32"):
    return Tensor(np.zeros(shape, dtype), device=device)


# id -> (operands built before the bad call, the bad call, what the message must name: each entry a tuple of
# acceptable spellings)
ERRORS = {
    "add_not_broadcastable": (
        lambda d: (zeros(d, 3, 4), zeros(d, 2, 4)),
        lambda a, b: a + b,
        [shape_text((3, 4)), shape_text((2, 4))],
    ),
    "mul_not_broadcastable_3d": (
        lambda d: (zeros(d, 3, 1, 5), zeros(d, 4, 2)),
        lambda a, b: a * b,
        [shape_text((3, 1, 5)), shape_text((4, 2))],
    ),
    "where_not_broadcastable": (
        lambda d: (zeros(d, 3, dtype="bool"), zeros(d, 3), zeros(d, 4)),
        lambda c, a, b: Tensor.where(c, a, b),
        [shape_text((4,))],
    ),
    "matmul_inner_dims": (
        lambda d: (zeros(d, 3, 4), zeros(d, 5, 2)),
        lambda a, b: a @ b,
        [shape_text((3, 4)), shape_text((5, 2))],
    ),
    "matmul_1d_inner_dims": (lambda d: (zeros(d, 5), zeros(d, 4)), lambda a, b: a.matmul(b), [("5",), ("4",)]),
    "matmul_batch_not_broadcastable": (
        lambda d: (zeros(d, 2, 3, 4), zeros(d, 3, 4, 5)),
        lambda a, b: a @ b,
        [shape_text((2, 3, 4)) + ("(2,)",), shape_text((3, 4, 5)) + ("(3,)",)],  # full or batch shapes
    ),
    "sum_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.sum(axis=7), [("7",)]),
    "max_bad_negative_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.max(axis=-9), [("-9",)]),
    "mean_bad_axis_in_tuple": (lambda d: (zeros(d, 3, 5),), lambda t: t.mean(axis=(0, 6)), [("6",)]),
    "softmax_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.softmax(axis=4), [("4",)]),
    "argmax_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.argmax(axis=8), [("8",)]),
    "permute_bad_dim": (lambda d: (zeros(d, 3, 5),), lambda t: t.permute(0, 6), [("6",)]),
    "permute_repeated_dim": (lambda d: (zeros(d, 3, 5),), lambda t: t.permute(1, 1), [shape_text((1, 1))]),
    "transpose_bad_dim": (lambda d: (zeros(d, 3, 5),), lambda t: t.transpose(0, 6), [("6",)]),
    "squeeze_bad_axis": (lambda d: (zeros(d, 3, 1),), lambda t: t.squeeze(8), [("8",)]),
    "unsqueeze_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.unsqueeze(9), [("9",)]),
    "flip_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.flip(7), [("7",)]),
    "layernorm_bad_axis": (lambda d: (zeros(d, 3, 5),), lambda t: t.layernorm(axis=6), [("6",)]),
    "cat_bad_axis": (lambda d: (zeros(d, 2, 5), zeros(d, 2, 5)), lambda a, b: Tensor.cat([a, b], axis=3), [("3",)]),
    "cat_shape_mismatch": (
        lambda d: (zeros(d, 2, 3), zeros(d, 2, 4)),
        lambda a, b: Tensor.cat([a, b], axis=0),
        [shape_text((2, 4))],
    ),
    "stack_shape_mismatch": (
        lambda d: (zeros(d, 2, 3), zeros(d, 3, 2)),
        lambda a, b: Tensor.stack([a, b]),
        [shape_text((3, 2))],
    ),
    "bad_dtype_name": (lambda d: (), lambda: Tensor([1.0], dtype="float33"), [("float33",)]),
    "bad_dtype_name_in_cast": (lambda d: (zeros(d, 2),), lambda t: t.cast("int3"), [("int3",)]),
    "bad_dtype_name_in_factory": (lambda d: (), lambda: Tensor.zeros(2, dtype="floot"), [("floot",)]),
    "unknown_backend": (lambda d: (), lambda: Tensor([1.0], device="nope:0"), [("nope:0",)]),
    "unknown_device_index": (
        lambda d: (d.split(":")[0] + ":99",),
        lambda name: Tensor.zeros(2, device=name),
        [(":99",)],
    ),
    "to_unknown_device": (lambda d: (zeros(d, 2),), lambda t: t.to("nope:0"), [("nope:0",)]),
    "pad_too_many_axes": (
        lambda d: (zeros(d, 2, 3),),
        lambda t: t.pad(((1, 1), (1, 1), (1, 1))),
        [shape_text(((1, 1), (1, 1), (1, 1))) + shape_text((2, 3))],
    ),
    "pad_not_pairs": (lambda d: (zeros(d, 2, 3),), lambda t: t.pad(((1, 2, 3), (0, 0))), [shape_text((1, 2, 3))]),
    "reshape_two_minus_one": (lambda d: (zeros(d, 3, 4),), lambda t: t.reshape(-1, -1), [shape_text((-1, -1))]),
    "reshape_wrong_numel": (
        lambda d: (zeros(d, 3, 4),),
        lambda t: t.reshape(5, 5),
        [shape_text((5, 5)) + ("25",)],
    ),
    "reshape_minus_one_not_dividing": (lambda d: (zeros(d, 3, 4),), lambda t: t.reshape(5, -1), [shape_text((5, -1))]),
    "expand_incompatible": (lambda d: (zeros(d, 3, 2),), lambda t: t.expand(3, 4), [shape_text((3, 4))]),
    "index_out_of_range": (lambda d: (zeros(d, 4, 5),), lambda t: t[7], [("7",)]),
    "negative_index_out_of_range": (lambda d: (zeros(d, 4, 5),), lambda t: t[-6], [("-6",)]),
    "second_index_out_of_range": (lambda d: (zeros(d, 4, 5),), lambda t: t[0, 9], [("9",)]),
    "too_many_indices": (lambda d: (zeros(d, 4, 5),), lambda t: t[0, 0, 0], [shape_text((4, 5)) + ("3",)]),
    "index_with_float_tensor": (
        lambda d: (zeros(d, 4, 5), zeros(d, 2)),
        lambda t, i: t[i],
        [("float32",)],
    ),
    "gather_float_index": (
        lambda d: (zeros(d, 4, 5), zeros(d, 4, 2)),
        lambda t, i: t.gather(1, i),
        [("float32",)],
    ),
    "conv2d_channel_mismatch": (
        lambda d: (zeros(d, 1, 3, 5, 5), zeros(d, 2, 4, 3, 3)),
        lambda x, w: x.conv2d(w),
        [shape_text((1, 3, 5, 5)) + shape_text((2, 4, 3, 3))],
    ),
    "bitwise_on_float": (lambda d: (zeros(d, 3), zeros(d, 3)), lambda a, b: a & b, [("float32",)]),
    "invert_on_float": (lambda d: (zeros(d, 3),), lambda a: ~a, [("float32",)]),
    "negative_size": (lambda d: (), lambda: Tensor.zeros(-1, 3), [("-1",)]),
    "arange_zero_step": (lambda d: (), lambda: Tensor.arange(0, 5, 0), [("0",)]),
    "ragged_list": (lambda d: (), lambda: Tensor([[1.0, 2.0], [3.0]]), []),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_at_the_call_and_runtime_keeps_working(device, case):
    make_operands, bad_call, named = ERRORS[case]
    pending = Tensor(np.arange(6, dtype=np.float32), device=device) * 2.0 + 1.0  # built before the error
    operands = make_operands(device)
    with pytest.raises(azyx.AzyxError) as info:
        bad_call(*operands)
    message = str(info.value)
    for spellings in named:
        assert any(s in message for s in spellings), f"{case}: message {message!r} names none of {spellings}"
    # the runtime is still usable: earlier lazy work, the operands and new work all realize correctly
    np.testing.assert_array_equal(pending.numpy_sync(), np.arange(6) * 2.0 + 1.0)
    for t in operands:
        if isinstance(t, Tensor):
            np.testing.assert_array_equal(t.numpy_sync(), np.zeros(t.shape))
    np.testing.assert_array_equal((Tensor([1.0, 2.0], device=device) + 1.0).numpy_sync(), [2.0, 3.0])


async def test_item_of_many_elements_raises(device):
    t = Tensor([1.0, 2.0, 3.0], device=device)
    with pytest.raises(azyx.AzyxError) as info:
        await t.item()
    assert any(s in str(info.value) for s in shape_text((3,)) + ("3 elements",)), str(info.value)
    assert await t.sum().item() == 6.0


async def test_sync_escape_hatch_inside_a_running_loop_raises(device):
    t = Tensor([1.0, 2.0], device=device) + 1.0
    with pytest.raises(azyx.AzyxError):
        t.numpy_sync()
    with pytest.raises(azyx.AzyxError):
        t.realize_sync()
    np.testing.assert_array_equal(await t.numpy(), [2.0, 3.0])


def test_errors_are_distinguishable_subclasses():
    assert issubclass(azyx.AzyxError, Exception)
    assert not issubclass(azyx.AzyxError, AssertionError)
