"""azyx's native core (azyx/_native.c), built for Python's stable ABI; azyx runs without it where no compiler is."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("azyx._native", ["azyx/_native.c"], py_limited_api=True, optional=True,
                             define_macros=[("Py_LIMITED_API", "0x030B0000")],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers", "-Wno-cast-function-type"])],
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
