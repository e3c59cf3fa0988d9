"""azyx's native core (azyx/csrc, the module azyx._native), built for Python's stable ABI; azyx runs without it where
no compiler is. Its ABI is a hash of its sources (azyx/csrc/__init__.py), which the module keeps: azyx.native refuses
a module built from other sources."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location("azyx_csrc", Path(__file__).parent / "azyx" / "csrc" / "__init__.py")
assert _spec is not None and _spec.loader is not None
csrc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(csrc)  # (by path: importing azyx itself needs its dependencies, not there at build time)
abi = csrc.source_abi()
assert abi is not None, "azyx/csrc: a source file is missing"

setup(ext_modules=[Extension("azyx._native", [f"azyx/csrc/{name}" for name in csrc.SOURCES if name.endswith(".c")],
                             depends=["azyx/csrc/native.h"], py_limited_api=True, optional=True,
                             define_macros=[("Py_LIMITED_API", "0x030B0000"), ("AZYX_ABI", f'"{abi}"')],
                             extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-Wextra",
                                                 "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                                                 "-Wno-cast-function-type"])],
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
