"""Configuration: JSON at $AZYX_CONFIG, else $XDG_CONFIG_HOME/azyx/config.json (else ~/.config/azyx/),
sections per backend; a missing file or section means defaults. `azyx.configure(dict)` does the same
from code."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from azyx.errors import AzyxError

# seconds a device's compiler may take for one batch of kernels: past it the compile is abandoned (a C compiler's
# whole process group is killed) and the realize raises CompileError
COMPILE_TIMEOUT_S = 120.0

# the sections of the settings that configure no backend; each backend's own section (its defaults) is the `CONFIG` of
# its module, which `add_backends` puts before these (azyx.registry does, as it is imported)
DEFAULTS: dict[str, dict[str, Any]] = {
    # ExecutionPlans kept for graphs of a structure seen before (least recently used go first): a service that sees
    # ever new shapes must not grow without bound
    # auto: the backends AUTO places work on (device=None), in no order of their own: their devices are ranked by their
    # speed estimates (Device.compute); where none of them has a device, every backend's devices are. Others are used
    # where named (`device="wgpu:0"`), and are not probed until then
    # (the default: the backends whose module says `AUTO = True`)
    "runtime": {"plan_cache_size": 1024, "auto": []},
    # kernel search (azyx.search): level "off" (the heuristics, or a winner already in the disk cache), "quick" or
    # "thorough"; budget_s: seconds one kernel's search may take. $AZYX_SEARCH and $AZYX_SEARCH_BUDGET override them
    "search": {"level": "off", "budget_s": 10.0},
}
SEARCH_LEVELS = ("off", "quick", "thorough")
SETTINGS = ("runtime", "search")  # the sections that configure no backend
# what every backend's section takes beside its own defaults (Device: how many devices, its memory, compile limit;
# device_ids: the physical devices to use, where the backend chooses among several)
BACKEND_KEYS = ("enabled", "devices", "memory", "compile_timeout_s", "device_ids")


class ConfigError(AzyxError, ValueError):
    """A malformed configuration file or dict."""


def add_backends(sections: dict[str, dict[str, Any]], auto: list[str]) -> None:
    """Add the backends' sections (kind -> its defaults) to DEFAULTS, before the settings' (each also takes
    `compile_timeout_s`, COMPILE_TIMEOUT_S by default), and make `auto` the default of `runtime.auto`."""
    settings = {k: DEFAULTS.pop(k) for k in SETTINGS}
    DEFAULTS.update({kind: {**row, "compile_timeout_s": row.get("compile_timeout_s", COMPILE_TIMEOUT_S)}
                     for kind, row in sections.items()})
    DEFAULTS.update(settings)
    DEFAULTS["runtime"]["auto"] = list(auto)


def config_path() -> Path:
    if p := os.environ.get("AZYX_CONFIG"):
        return Path(p)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "azyx" / "config.json"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "azyx"


def _unknown(what: str, name: Any, known: list[str]) -> ConfigError:
    """The error for a section or key azyx does not know, naming it, the nearest known name, and all of them."""
    import difflib  # (a typo's path only)

    near = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"unknown config {what} {name!r}{hint}; known: {', '.join(known)}")


def merge(base: dict[str, dict[str, Any]], extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`extra`'s sections over `base`'s; a section or key azyx does not know raises ConfigError naming it (a typo
    would otherwise be ignored silently)."""
    out = copy.deepcopy(base)
    if not isinstance(extra, dict):
        raise ConfigError(f"configuration must be a dict of sections, got {type(extra).__name__}")
    for section, values in extra.items():
        if section not in DEFAULTS:
            raise _unknown("section", section, list(DEFAULTS))
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a dict, got {values!r}")
        known = list(DEFAULTS[section]) + [k for k in BACKEND_KEYS if section not in SETTINGS
                                           and k not in DEFAULTS[section]]
        for key in values:
            if key not in known:
                raise _unknown("key", f"{section}.{key}", [f"{section}.{k}" for k in known])
        out.setdefault(section, {}).update(values)
    return out


def load(overrides: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    cfg = copy.deepcopy(DEFAULTS)
    path = config_path()
    if path.is_file():
        try:
            cfg = merge(cfg, json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    if overrides:
        cfg = merge(cfg, overrides)
    return cfg


def plan_cache_size(cfg: dict[str, dict[str, Any]]) -> int:
    """The `runtime` section's `plan_cache_size`: a positive int."""
    size = cfg.get("runtime", {}).get("plan_cache_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"runtime.plan_cache_size must be a positive int, got {size!r}")
    return size


def auto_backends(cfg: dict[str, dict[str, Any]]) -> list[str]:
    """The `runtime` section's `auto`: the backends AUTO places work on (a list of backend names)."""
    auto = cfg.get("runtime", {}).get("auto")
    backends = [s for s in DEFAULTS if s not in SETTINGS]
    if not isinstance(auto, list | tuple) or any(k not in backends for k in auto):
        raise ConfigError(f"runtime.auto must be a list of backends ({', '.join(backends)}), got {auto!r}")
    return list(auto)


class SearchConfigError(ConfigError):
    """A search level or budget that is not one (config `search` section, $AZYX_SEARCH, $AZYX_SEARCH_BUDGET)."""


def search_settings(cfg: dict[str, dict[str, Any]]) -> tuple[str, float]:
    """(level, per-kernel budget in seconds) of the kernel search: $AZYX_SEARCH and $AZYX_SEARCH_BUDGET over the
    `search` section."""
    section = cfg.get("search", {})
    level = os.environ.get("AZYX_SEARCH") or section.get("level", "off")
    where = "AZYX_SEARCH" if os.environ.get("AZYX_SEARCH") else "search.level"
    if level not in SEARCH_LEVELS:
        raise SearchConfigError(f"{where} must be one of {', '.join(SEARCH_LEVELS)}, got {level!r}")
    raw: Any = os.environ.get("AZYX_SEARCH_BUDGET") or section.get("budget_s", 10.0)
    where = "AZYX_SEARCH_BUDGET" if os.environ.get("AZYX_SEARCH_BUDGET") else "search.budget_s"
    try:
        budget = float(raw) if not isinstance(raw, bool) else float("nan")
    except (TypeError, ValueError):
        budget = float("nan")
    if not budget > 0:
        raise SearchConfigError(f"{where} must be a positive number of seconds, got {raw!r}")
    return level, budget
