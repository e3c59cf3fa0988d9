"""The search's newer actions (azyx.optimize): reduce unrolls (UNROLL), vector widths (VECTOR), GPU product tiles
(BLOCK on CUDA and Vulkan) and the parts of split reductions (SPLIT). Each is rendered from the winner cache on every
device that lists it and gives numpy's results; each refuses kernels it does not fit; a search that tries them keeps
the heuristic kernels' results; the cache round-trips them and never trusts a corrupt or stale entry."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import azyx
from azyx import Tensor, debug
from azyx.codegen import search_actions
from azyx.codegen.dialect import CUDA, GLSL, OPENCL, SHADER_TILES, WARP_TILES, C
from azyx.codegen.kernel import render_kernel
from azyx.codegen.render import kernel_source
from azyx.codegen.search_actions import SPLIT, UNROLL, VECTOR, Opt, OptError
from azyx.codegen.templates import gemm
from azyx.ir import Kernel
from azyx.plan import KernelStep
from azyx.runtime import RT

Build = Callable[[str], tuple[Tensor, np.ndarray]]
RNG = np.random.default_rng(7)
X = RNG.standard_normal((64, 512), dtype=np.float32)  # rows of 512: every unroll and vector width divides them
ODD = RNG.standard_normal((24, 257), dtype=np.float32)  # rows of 257: none does


def _rows(device: str) -> tuple[Tensor, np.ndarray]:
    return Tensor(X, device=device).sum(axis=1), X.sum(axis=1)


def _rows_max(device: str) -> tuple[Tensor, np.ndarray]:
    return (Tensor(X, device=device) * 2).max(axis=1), (X * 2).max(axis=1)


def _columns(device: str) -> tuple[Tensor, np.ndarray]:  # reduced along a strided axis
    return Tensor(X, device=device).sum(axis=0), X.sum(axis=0)


def _elementwise(device: str) -> tuple[Tensor, np.ndarray]:
    return (Tensor(X, device=device) * 2 + 1).exp(), np.exp(X * 2 + 1)


def _product(device: str) -> tuple[Tensor, np.ndarray]:  # (8 rows: the generic, register-tiled kernel on the host)
    a, b = X[:8, :64], X[:64, :128]
    return Tensor(a, device=device) @ Tensor(b, device=device), a @ b


def _step(t: Tensor) -> KernelStep:
    (step,) = azyx.schedule(t).kernels
    return step


def _kernel(t: Tensor) -> Kernel:
    return _step(t).kernel


def _run_with(device: str, build: Build, opts: search_actions.Opts) -> None:
    """Realize `build`'s graph with `opts` as its kernel's cached winner: the kernel is made with them, and the result
    is numpy's."""
    dev = RT.device(device)
    t, _ = build(device)
    k = _kernel(t)
    base = k.base or k
    full = (*k.opts, *opts)  # (the heuristic's register tiles kept)
    dev.winner_cache().put(search_actions.kernel_key(base), full, {})
    RT.plan_cache.clear()
    t, ref = build(device)
    assert _step(t).name == dev.render_ir(search_actions.apply(base, full))[0]  # (the step keeps the planner's kernel)
    np.testing.assert_allclose(t.numpy_sync(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("amount", [2, 4, 8])
def test_unrolled_reduces_give_numpy_results(device: str, fresh_cache: Path, amount: int) -> None:
    if UNROLL not in RT.device(device).search_actions:
        pytest.skip(f"{device} lists no unroll")
    for build in (_rows, _rows_max, _columns, _product):
        _run_with(device, build, (Opt(UNROLL, 0, amount),))


@pytest.mark.parametrize("width", [1, 2, 4])
def test_vector_widths_give_numpy_results(device: str, fresh_cache: Path, width: int) -> None:
    dev = RT.device(device)
    if VECTOR not in dev.search_actions:
        pytest.skip(f"{device} has no vector types")
    for build in (_elementwise, _rows):
        _run_with(device, build, (Opt(VECTOR, 0, width),))


def test_actions_that_do_not_fit_raise_and_are_not_offered() -> None:
    odd = Tensor(ODD, device="c:0")
    k = _kernel(odd.sum(axis=1))
    with pytest.raises(OptError, match="does not divide"):
        search_actions.apply(k, (Opt(UNROLL, 0, 4),))
    with pytest.raises(OptError, match="vector"):
        search_actions.apply(k, (Opt(VECTOR, 0, 4),))  # rows of 257: no aligned vectors along them
    with pytest.raises(OptError, match="vector"):  # reduced along a strided axis
        search_actions.apply(_kernel(Tensor(X, device="c:0").sum(axis=0)), (Opt(VECTOR, 0, 2),))
    with pytest.raises(OptError, match="vector"):  # 255 points: not whole vectors
        search_actions.apply(_kernel((Tensor(ODD[0, :255], device="c:0") * 2).exp()), (Opt(VECTOR, 0, 4),))
    with pytest.raises(OptError, match="flat reduces"):  # no reduce to unroll
        search_actions.apply(_kernel((odd * 2).exp()), (Opt(UNROLL, 0, 2),))
    with pytest.raises(OptError, match="plan's action"):
        search_actions.apply(k, (Opt(SPLIT, 0, 16),))
    actions = frozenset(search_actions.KINDS)
    for level in ("quick", "thorough"):
        for dl in (OPENCL, GLSL, CUDA):
            kinds = {o.kind for c in search_actions.candidates(k, dl, actions, level) for o in c}
            assert UNROLL not in kinds and VECTOR not in kinds, (dl.name, level, kinds)
        good = _kernel(Tensor(X, device="c:0").sum(axis=1))
        kinds = {o.kind for c in search_actions.candidates(good, OPENCL, actions, level) for o in c}
        assert {UNROLL, VECTOR} <= kinds, (level, kinds)


def test_renderers_read_unroll_and_vector_as_facts() -> None:
    """The source has the unrolled steps and the vector accesses each dialect has; launches follow the width."""
    k = _kernel(Tensor(X, device="c:0").sum(axis=1))
    e = _kernel((Tensor(X, device="c:0") * 2).exp())
    plain = render_kernel(k, C)[1]
    unrolled = render_kernel(search_actions.apply(k, (Opt(UNROLL, 0, 4),)), C)[1]
    assert "r0_u += 4" in unrolled and "r0 = r0_u + 3;" in unrolled and "r0_u" not in plain
    k8 = search_actions.apply(k, (Opt(UNROLL, 0, 8),))
    assert "rl0 += 512" in render_kernel(k8, OPENCL)[1]  # 8 steps of 64 items
    for dl, load in ((OPENCL, "vload2("), (CUDA, "float2"), (GLSL, "vec2")):
        _, src, launch = render_kernel(search_actions.apply(e, (Opt(VECTOR, 0, 2),)), dl)
        assert load in src and launch.items >= e.global_size // 2
        assert launch.grid[0] * launch.group < e.global_size
    _, src, launch = render_kernel(search_actions.apply(e, (Opt(VECTOR, 0, 1),)), CUDA)
    assert "float4" not in src and "float2" not in src and launch.items >= e.global_size
    assert "vload" not in render_kernel(e, OPENCL)[1]  # (OpenCL's default: none)


def test_a_search_with_the_new_actions_keeps_the_heuristic_results(device: str, fresh_cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    dev = RT.device(device)
    monkeypatch.setattr(debug, "LEVEL", debug.SEARCH)
    builds = (_rows, _elementwise, _product)
    heuristic = [build(device)[0].numpy_sync() for build in builds]
    targets = [build(device) for build in builds]
    found = azyx.tune_sync(*(t for t, _ in targets), level="quick")
    assert found and all(r.rejected == 0 for r in found), [(r.key, r.rejected) for r in found]
    err = capsys.readouterr().err
    new = {UNROLL, VECTOR} & dev.search_actions
    assert all(f"[{kind}(" in err or f", {kind}(" in err for kind in new), err[-3000:]  # each was tried
    for (t, ref), h in zip(targets, heuristic):
        got = t.numpy_sync()
        np.testing.assert_allclose(got, h, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_the_cache_round_trips_new_actions_and_ignores_bad_ones(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(debug, "LEVEL", debug.SEARCH)
    opts = (Opt(UNROLL, 0, 4), Opt(VECTOR, 0, 2), Opt(search_actions.BLOCK, 0, 3), Opt(SPLIT, 0, 256))
    assert search_actions.decode(json.loads(json.dumps(search_actions.encode(opts)))) == opts
    dev = RT.device("opencl:0" if "opencl:0" in azyx.devices() else "c:0")
    t, ref = _rows(dev.name)
    k = _kernel(t)
    key = search_actions.kernel_key(k.base or k)
    cache = dev.winner_cache()
    cache.put(key, (Opt(UNROLL, 0, 4),), {})
    dev.__dict__.pop("_winners")  # (read again from disk)
    assert dev.tuned(k).unroll == 4 and dev.tuned(k).opts == (Opt(UNROLL, 0, 4),)
    for bad in ((Opt(UNROLL, 0, 3),), (Opt(VECTOR, 0, 3),), (Opt(SPLIT, 0, 2),)):  # fits nothing here
        cache.put(key, bad, {})
        dev.__dict__.pop("_winners")
        assert dev.tuned(k) is k
        assert "do not apply" in capsys.readouterr().err
    data = json.loads(cache.path.read_text())
    data["winners"][key] = {"opts": [["unroll", 0, -4]]}  # corrupt
    cache.path.write_text(json.dumps(data))
    dev.__dict__.pop("_winners")
    assert dev.tuned(k) is k and "corrupt" in capsys.readouterr().err
    data["format"] = search_actions.FORMAT - 1  # a file from before these actions: searched again
    cache.path.write_text(json.dumps(data))
    dev.__dict__.pop("_winners")
    assert dev.winners is None and "stale" in capsys.readouterr().err
    RT.plan_cache.clear()
    np.testing.assert_allclose(_rows(dev.name)[0].numpy_sync(), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------ split reductions
SPLIT_DEVICES = [d for d in ("c:0", "opencl:0", "vulkan:0", "wgpu:0") if d in azyx.devices()]
BIG = RNG.standard_normal(1 << 18, dtype=np.float32)


def _total(device: str) -> tuple[Tensor, np.ndarray]:
    return Tensor(BIG, device=device).sum(), BIG.astype(np.float64).sum()


@pytest.mark.parametrize("device", SPLIT_DEVICES)
def test_split_parts_come_from_the_cache_and_give_numpy_results(device: str, fresh_cache: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(debug, "LEVEL", debug.SEARCH)
    dev = RT.device(device)
    if dev.threads < 2 and not dev.dialect.global_ids:
        pytest.skip(f"{device} runs on one thread: it splits nothing")
    t, ref = _total(device)
    plan = azyx.schedule(t)
    ((where, site),) = plan.splits
    assert where == device and site.kind == search_actions.ROWS and site.r == BIG.size and site.outputs == 1
    assert site.heuristic > 1 and len(plan.kernels) == 2  # split by the heuristic: two stages
    cache = dev.winner_cache()
    for parts, kernels in ((0, 1), (64, 2), (4096, 2)):
        cache.put(site.key, (Opt(SPLIT, 0, parts),), {})
        RT.plan_cache.clear()
        t, ref = _total(device)
        steps = azyx.schedule(t).kernels
        assert len(steps) == kernels and (parts == 0 or (steps[0].kernel.base or steps[0].kernel).global_size == parts)
        np.testing.assert_allclose(t.numpy_sync(), ref, rtol=1e-4)
    cache.put(site.key, (Opt(SPLIT, 0, 3),), {})  # not a divisor of 2**18: never trusted
    RT.plan_cache.clear()
    t, ref = _total(device)
    first = azyx.schedule(t).kernels[0].kernel
    assert (first.base or first).global_size == site.heuristic
    assert "not a split of it" in capsys.readouterr().err
    np.testing.assert_allclose(t.numpy_sync(), ref, rtol=1e-4)


@pytest.mark.parametrize("device", [d for d in SPLIT_DEVICES if d in ("c:0", "opencl:0")])
def test_tune_searches_the_parts_of_a_split_and_caches_them(device: str, fresh_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(debug, "LEVEL", debug.SEARCH)
    if RT.device(device).threads < 2 and device == "c:0":
        pytest.skip("c:0 runs on one thread: it splits nothing")
    t, ref = _total(device)
    found = [r for r in azyx.tune_sync(t, level="quick") if r.key.startswith("split:")]
    assert len(found) == 1 and not found[0].cached and found[0].rejected == 0 and found[0].tried >= 3
    err = capsys.readouterr().err
    assert "0 parts" in err and f"{found[0].key}: 4 tried" in err  # the heuristic, no split and two others
    (winner,) = found[0].winner
    assert winner.kind == SPLIT
    np.testing.assert_allclose(t.numpy_sync(), ref, rtol=1e-4)
    again, _ = _total(device)
    assert [r.cached for r in azyx.tune_sync(again) if r.key.startswith("split:")] == [True]
    steps = azyx.schedule(again).kernels
    assert len(steps) == (2 if winner.amount else 1)
    np.testing.assert_allclose(again.numpy_sync(), ref, rtol=1e-4)


def test_split_candidates_are_divisors_and_no_split() -> None:
    site = search_actions.SplitSite(search_actions.ROWS, "sum", "float32", 1, 3 * (1 << 16), 1024)
    quick, thorough = search_actions.split_candidates(site, "quick"), search_actions.split_candidates(site, "thorough")
    assert quick[0] == 0 and 1024 not in quick and len(quick) == 3 and set(quick) < set(thorough) | {0}
    assert all(p == 0 or site.r % p == 0 for p in thorough) and len(thorough) >= 5
    cols = search_actions.SplitSite(search_actions.COLUMNS, "sum", "float32", 4096, 1000, 50)
    assert all(p == 0 or (1000 % p == 0 and p >= 2) for p in search_actions.split_candidates(cols, "thorough"))
    assert not site.fits(7) and site.fits(0) and site.fits(3)


# ------------------------------------------------------------------------------------------------ GPU product tiles
def _products(dev_name: str, target: str) -> list[Kernel]:
    """The product kernels (those `target`'s template takes) of float32 and float16 products in two layouts."""
    rng = np.random.default_rng(0)
    out = []
    for (m, k, n), dtype in (((256, 128, 192), "float32"), ((4096, 256, 4096), "float32"), ((100, 72, 36), "float32"),
                             ((512, 256, 512), "float16")):
        a = Tensor(rng.standard_normal((m, k)).astype(dtype), device=dev_name)
        b = Tensor(rng.standard_normal((n, k)).astype(dtype), device=dev_name)
        c = Tensor(rng.standard_normal((k, n)).astype(dtype), device=dev_name)
        for product in (a @ b.T, a @ c):
            out += [s.kernel for s in azyx.schedule(product).kernels if gemm.match(s.kernel, target, True)]
    return out


@pytest.fixture
def gpu_planning(monkeypatch: pytest.MonkeyPatch) -> Callable[[object], None]:
    dev = RT.device("dummy:0")
    monkeypatch.setattr(dev, "tiles", False)
    monkeypatch.setattr(dev, "capacity", 1 << 31)

    def use(dialect: object) -> None:
        monkeypatch.setattr(dev, "dialect", dialect)
        RT.plan_cache.clear()

    yield use
    RT.plan_cache.clear()


def test_cuda_product_tiles_are_searched_and_every_one_compiles(gpu_planning: Callable[[object], None]) -> None:
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from azyx.backends.cuda_driver import nvrtc_compile

    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVRTC unavailable: {e}")
    gpu_planning(CUDA)
    sources, tiles = {}, set()
    for k in _products("dummy:0", WARP_TILES):
        cands = search_actions.candidates(k, CUDA, frozenset(search_actions.KINDS), "quick")
        assert cands and all(len(c) == 1 and c[0].kind == search_actions.BLOCK for c in cands)
        configs = {gemm.tile_config(gemm.match(search_actions.apply(k, c), WARP_TILES, True)) for c in cands}
        assert len(cands) == len(configs)
        for c in cands:
            t = search_actions.apply(k, c)
            tg = gemm.match(t, WARP_TILES, True)
            name, src, launch = render_kernel(t, CUDA, 1, sm90=132)
            assert tg is not None and launch.group == tg.threads and launch.grid == tg.grid()
            assert ("mma.sync" in src) == tg.mma
            tiles.add((tg.dtype, tg.tile))
            sources[name] = src
    assert {t for d, t in tiles if d == "float32"} >= {(128, 128), (128, 64), (64, 64), (64, 128)}
    assert {t for d, t in tiles if d == "float16"} >= {(128, 128), (64, 64)}
    assert nvrtc_compile(kernel_source(list(sources.values()), CUDA), "sm_90")[:4] == b"\x7fELF"


@pytest.mark.skipif(shutil.which("glslc") is None, reason="glslc is not installed")
def test_vulkan_product_tiles_are_searched_and_every_one_compiles(gpu_planning: Callable[[object], None],
                                                                   tmp_path: Path) -> None:
    from azyx.codegen.dialect import glsl_dialect as dialect_for

    dl = dialect_for((), True, 32)  # a GPU's GLSL: products in the tiled shader
    gpu_planning(dl)
    tiles = set()
    for k in _products("dummy:0", SHADER_TILES):  # (float16 products: the generic kernel on Vulkan)
        cands = search_actions.candidates(k, dl, frozenset(search_actions.KINDS), "quick")
        assert cands and all(c[0].kind == search_actions.BLOCK for c in cands)
        for c in cands:
            name, src, launch = render_kernel(search_actions.apply(k, c), dl)
            g = gemm.match(search_actions.apply(k, c), SHADER_TILES)
            assert g is not None
            tiles.add(g.tile)
            assert launch.grid == g.grid() and f"As[2][8][{g.tile[0] // 4 + 1}]" in src
            path, spv = tmp_path / f"{name}.comp", tmp_path / f"{name}.spv"
            path.write_text(src)
            r = subprocess.run(["glslc", "-fshader-stage=compute", "--target-env=vulkan1.2", "-O", str(path), "-o",
                                str(spv)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
    assert tiles >= {(64, 64), (128, 128), (64, 128)}
