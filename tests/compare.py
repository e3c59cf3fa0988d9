"""Shared by the op tests: random inputs per domain, and realize-then-compare against a numpy reference."""

import numpy as np

from azyx import dtypes

# Float tolerances per result dtype; int and bool results compare exactly.
TOL = {
    np.dtype(np.float16): {"rtol": 5e-3, "atol": 5e-3},
    np.dtype(np.float32): {"rtol": 1e-5, "atol": 1e-6},
    np.dtype(np.float64): {"rtol": 1e-10, "atol": 1e-12},
}

# Input domains for ops with a restricted one (log, sqrt, division, tan) and for int/bool inputs.
FLOAT_RANGES = {"any": (-3.0, 3.0), "pos": (0.1, 4.0), "small": (-1.2, 1.2), "unit": (0.5, 1.5)}
INT_RANGES = {"int": (-9, 10), "int_exp": (0, 5)}


def sample(rng: np.random.Generator, shape: tuple[int, ...], domain: str = "any", dtype: str = "float32") -> np.ndarray:
    """Random array of `shape` in `domain`: "any" (with one exact 0), "pos", "small", "unit", "nonzero" (|x| >= 0.25),
    "int" (-9..9), "int_nonzero", "int_exp" (0..4), "bool"."""
    if domain == "bool":
        return rng.random(shape) < 0.5
    if domain in INT_RANGES:
        return np.asarray(rng.integers(*INT_RANGES[domain], size=shape)).astype(dtype)
    if domain == "int_nonzero":
        magnitude = rng.integers(1, 10, size=shape)
        return np.asarray(magnitude * rng.choice([-1, 1], size=shape)).astype(dtype)
    if domain == "nonzero":
        x = rng.uniform(0.25, 3.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
        return np.asarray(x).astype(dtype)
    x = np.asarray(rng.uniform(*FLOAT_RANGES[domain], size=shape)).astype(dtype)
    if domain == "any" and x.size > 1:
        x.flat[0] = 0  # exact zero: sign(0), relu(0), comparisons against 0
    return x


def assert_matches(t, ref, dtype: str | None = None, **tol: float) -> np.ndarray:
    """Realize `t` with numpy_sync and compare with `ref`: same shape, dtype `dtype` (a numpy dtype name) when given,
    exact values for int/bool results, allclose with the result dtype's tolerance (overridable) for floats."""
    out = t.numpy_sync()
    ref = np.asarray(ref)
    assert isinstance(out, np.ndarray), type(out)
    assert tuple(t.shape) == out.shape == ref.shape, f"tensor {t.shape}, numpy {out.shape}, reference {ref.shape}"
    if dtype is not None:
        assert t.dtype == getattr(dtypes, dtype), f"tensor dtype {t.dtype}, expected {dtype}"
        assert out.dtype == np.dtype(dtype), f"numpy dtype {out.dtype}, expected {dtype}"
    if out.dtype.kind in "biu" and ref.dtype.kind in "biu":
        np.testing.assert_array_equal(out, ref)
    else:
        np.testing.assert_allclose(out, ref, **(TOL.get(out.dtype, TOL[np.dtype(np.float32)]) | tol))
    return out
