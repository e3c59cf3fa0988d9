"""Kernel search (azyx.search, azyx.optimize): searched kernels give the heuristic kernels' results on every device,
winners are cached on disk (a second process searches nothing), corrupt or stale entries are never trusted, and bad
settings raise errors naming the value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import azyx
from azyx import Tensor, debug, search
from azyx.codegen import search_actions
from azyx.config import SearchConfigError
from azyx.runtime import RT

ROOT = Path(__file__).resolve().parent.parent


def _graphs(device: str) -> tuple[list[Tensor], list[np.ndarray]]:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((32, 48), dtype=np.float32)
    b = rng.standard_normal((48, 64), dtype=np.float32)
    v = rng.standard_normal(32, dtype=np.float32)
    x = rng.standard_normal((64, 256), dtype=np.float32)
    ta, tb, tv, tx = (Tensor(t, device=device) for t in (a, b, v, x))
    outs = [ta @ tb, tv @ ta, tx.sum(axis=1), tx.max(axis=0), (tx * 2 + 1).exp()]
    refs = [a @ b, v @ a, x.sum(axis=1), x.max(axis=0), np.exp(x * 2 + 1)]
    return outs, refs


def test_searched_kernels_equal_heuristic_results_on_every_device(device: str, fresh_cache: Path) -> None:
    identity = RT.device(device).identity()  # what the winners are cached under: the hardware and its software
    assert identity["kind"] == device.split(":")[0] and all(v not in (None, "") for k, v in identity.items()
                                                            if k in ("driver", "nvrtc", "compiler", "device"))
    if device.startswith("cuda"):
        assert identity["arch"].startswith("sm_") and identity["driver"] > 0 and identity["nvrtc"] > 0, identity
    outs, refs = _graphs(device)
    heuristic = [t.numpy_sync() for t in outs]
    outs, _ = _graphs(device)
    before = search.searches
    found = azyx.tune_sync(*outs, level="quick")
    assert search.searches > before and found and all(not r.cached for r in found)
    assert all(r.rejected == 0 for r in found), [(r.key, r.rejected) for r in found]  # every candidate ran right
    for t, h, ref in zip(outs, heuristic, refs):
        got = t.numpy_sync()  # planned again: the winners, from the cache
        np.testing.assert_allclose(got, h, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    again, _ = _graphs(device)
    assert all(r.cached for r in azyx.tune_sync(*again)) and search.searches == before + len(found)


def test_search_on_realize_then_a_second_process_finds_the_cache(tmp_path: Path) -> None:
    script = (
        "import numpy as np, azyx\n"
        "from azyx import Tensor, search\n"
        "a = np.arange(64 * 96, dtype=np.float32).reshape(64, 96) % 7\n"
        "b = np.arange(96 * 128, dtype=np.float32).reshape(96, 128) % 5\n"
        "got = (Tensor(a, device='c:0') @ Tensor(b, device='c:0')).numpy_sync()\n"
        "assert np.array_equal(got, a @ b)\n"
        "print('SEARCHES', search.searches)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "AZYX_SEARCH": "quick", "AZYX_SEARCH_BUDGET": "20",
           "AZYX_DEBUG": "32", "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SEARCHES 1" in first.stdout and "won [" in first.stderr
    files = list((tmp_path / "azyx" / "search").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["format"] == search_actions.FORMAT
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "SEARCHES 0" in second.stdout and "won [" not in second.stderr


def test_corrupt_or_stale_cache_entries_are_ignored(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(debug, "LEVEL", debug.SEARCH)
    dev = RT.device("c:0")
    a, b = Tensor(np.ones((16, 32), np.float32), device="c:0"), Tensor(np.ones((32, 64), np.float32), device="c:0")
    step = azyx.schedule(a @ b).kernels[0]
    base = step.kernel.base or step.kernel
    key = search_actions.kernel_key(base)
    cache = dev.winner_cache()
    cache.put(key, (search_actions.Opt(search_actions.UPCAST, 7, 3),), {})  # a loop the kernel does not have
    dev.__dict__.pop("_winners")  # (read again from disk)
    assert dev.tuned(step.kernel) is step.kernel
    assert "do not apply" in capsys.readouterr().err
    data = json.loads(cache.path.read_text())
    data["winners"][key] = {"opts": [["upcast", "x", -1]]}  # corrupt
    cache.path.write_text(json.dumps(data))
    dev.__dict__.pop("_winners")
    assert dev.tuned(step.kernel) is step.kernel
    assert "corrupt" in capsys.readouterr().err
    cache.path.write_text("{not json")
    dev.__dict__.pop("_winners")
    assert dev.winners is None and "unreadable" in capsys.readouterr().err
    data["identity"] = {**data["identity"], "azyx": "0.0.0"}  # another version's file
    cache.path.write_text(json.dumps(data))
    dev.__dict__.pop("_winners")
    assert dev.winners is None and "stale" in capsys.readouterr().err
    np.testing.assert_allclose((a @ b).numpy_sync(), np.full((16, 64), 32.0))


def test_actions_rewrite_the_ir_as_the_planner_tiles_it() -> None:
    # (8 rows: a product of 16 or more takes the C backend's product template, tiled by its block sizes instead)
    a, b = Tensor(np.ones((8, 32), np.float32), device="c:0"), Tensor(np.ones((32, 64), np.float32), device="c:0")
    k = azyx.schedule(a @ b).kernels[0].kernel
    assert k.base is not None and [o.kind for o in k.opts] == ["upcast", "upcast", "swap"]
    assert search_actions.kernel_key(k.base) == search_actions.kernel_key(search_actions.apply(k.base, ()))
    tiled = search_actions.apply(k.base, (search_actions.Opt(search_actions.UPCAST, 1, 16),))
    assert [u.vmax + 1 for u in tiled.uvars] == [16] and [g.vmax + 1 for g in tiled.gvars] == [8, 4]
    with pytest.raises(search_actions.OptError, match="does not divide"):
        search_actions.apply(k.base, (search_actions.Opt(search_actions.UPCAST, 1, 48),))
    cands = search_actions.candidates(k.base, RT.device("c:0").dialect, RT.device("c:0").search_actions, "thorough")
    assert len(cands) > len(search_actions.candidates(k.base, RT.device("c:0").dialect,
                                                RT.device("c:0").search_actions, "quick")) > 3


def test_bad_search_settings_raise_naming_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SearchConfigError, match="'fast'"):
        azyx.configure({"search": {"level": "fast"}})
    with pytest.raises(azyx.AzyxError, match="-1"):
        azyx.configure({"search": {"budget_s": -1}})
    monkeypatch.setenv("AZYX_SEARCH", "always")
    with pytest.raises(SearchConfigError, match="AZYX_SEARCH.*'always'"):
        azyx.tune_sync(Tensor([1.0]) + 1)
    monkeypatch.setenv("AZYX_SEARCH", "quick")
    monkeypatch.setenv("AZYX_SEARCH_BUDGET", "soon")
    with pytest.raises(SearchConfigError, match="'soon'"):
        azyx.tune_sync(Tensor([1.0]) + 1)
    monkeypatch.delenv("AZYX_SEARCH_BUDGET")
    with pytest.raises(SearchConfigError, match="'max'"):
        azyx.tune_sync(Tensor([1.0]) + 1, level="max")


@pytest.mark.parametrize("level", ["quick", "thorough"])
def test_cuda_candidates_render_and_compile_with_nvrtc(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: every candidate the search would time on a CUDA device renders and NVRTC compiles for sm_90."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from azyx.backends.cuda_driver import nvrtc_compile
    from azyx.codegen.dialect import CUDA
    from azyx.codegen.kernel import render_kernel
    from azyx.codegen.render import kernel_source

    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVRTC unavailable: {e}")
    dev = RT.device("dummy:0")
    monkeypatch.setattr(dev, "dialect", CUDA)
    monkeypatch.setattr(dev, "tiles", False)
    RT.plan_cache.clear()
    rng = np.random.default_rng(0)
    a, b = (Tensor(rng.standard_normal(s, dtype=np.float32), device="dummy:0") for s in ((64, 128), (128, 96)))
    x = Tensor(rng.standard_normal((256, 512), dtype=np.float32), device="dummy:0")
    actions = frozenset(search_actions.KINDS)
    sources: dict[str, str] = {}
    for target in (a @ b, x.sum(axis=1), x.max(axis=0), (x * 2).exp()):
        for step in azyx.schedule(target).kernels:
            base = step.kernel.base or step.kernel
            cands = search_actions.candidates(base, CUDA, actions, level, step.kernel.opts)
            assert cands
            for opts in cands:
                name, src, launch = render_kernel(search_actions.apply(base, opts), CUDA)
                assert launch.group <= 1024 and min(launch.grid) >= 1
                sources[name] = src
    RT.plan_cache.clear()
    cubin = nvrtc_compile(kernel_source(list(sources.values()), CUDA), "sm_90")
    assert cubin[:4] == b"\x7fELF" and len(sources) > 10


def test_work_group_actions_reach_the_launch() -> None:
    """LOCAL and GROUP are facts the renderers read: the launch (and the source's work-group size) follow them."""
    from azyx.codegen.dialect import GLSL, OPENCL
    from azyx.codegen.kernel import render_kernel

    dev = RT.device("c:0")
    x = Tensor(np.ones((64, 4096), np.float32), device="c:0")
    base = azyx.schedule(x.sum(axis=1)).kernels[0].kernel
    for dl in (OPENCL, GLSL):
        _, _, heur = render_kernel(base, dl)
        assert heur.group == dl.group_size and heur.grid[0] == 64  # grouped: a group per row
        _, _, one = render_kernel(search_actions.apply(base, (search_actions.Opt(search_actions.GROUP, 0, 0),)), dl)
        assert one.group == 64 and one.grid[0] == 1  # one item per row, the 64 rows one group
        _, src, two = render_kernel(search_actions.apply(base, (search_actions.Opt(search_actions.GROUP, 0, 128),)), dl)
        assert two.group == 128 and "128" in src
    e = azyx.schedule((x * 2).exp()).kernels[0].kernel
    _, _, local = render_kernel(search_actions.apply(e, (search_actions.Opt(search_actions.LOCAL, 0, 32),)), OPENCL)
    sa = search_actions
    assert local.group == 32 and dev.search_actions == {sa.UPCAST, sa.SWAP, sa.BLOCK, sa.UNROLL}



def test_close_is_not_fooled_by_an_infinite_reference() -> None:
    """A candidate's result is compared with the heuristic kernel's up to float reassociation, the tolerance scaled
    by the reference's largest finite magnitude: an infinite value in the reference must not make every result
    close (it made a wrong kernel a winner)."""
    from azyx.dtypes import dtypes
    from azyx.search import _close

    float32 = dtypes.float32

    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000).astype(np.float32)
    ref[7] = np.inf
    garbage = rng.standard_normal(1000).astype(np.float32)
    garbage[7] = np.inf
    assert not _close(garbage, ref, float32)
    assert _close(ref * np.float32(1 + 1e-6), ref, float32)
