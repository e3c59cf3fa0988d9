"""The C backend's runtime (azyx/backends/c_runtime.c) on its own: built by gcc with a small driver, as every kernel
library carries it, and run through pools that live for one batch each."""

from __future__ import annotations

import shutil
import subprocess
from importlib.resources import files
from pathlib import Path

import pytest

DRIVER = r"""
#include <stdio.h>
static void add_one(long lo, long hi, void** args) {
  float* x = (float*)args[0];
  for (long i = lo; i < hi; i++) x[i] += 1;
}
int main(int argc, char** argv) {
  int rounds = atoi(argv[1]);
  static float x[4096];
  for (int r = 0; r < rounds; r++) {
    void* pool = azyx_pool_new(2);
    azyx_kernel fns[1] = {add_one};
    void* ptrs[1] = {x};
    long argc_[1] = {1}, trip[1] = {4096};
    unsigned char kinds[1] = {1};  /* shared: the pool's helper starts with this batch */
    azyx_run(pool, 1, fns, ptrs, argc_, kinds, trip);
    azyx_pool_free(pool);
  }
  long wrong = 0;
  for (int i = 0; i < 4096; i++) wrong += x[i] != (float)rounds;
  printf("%ld\n", wrong);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_a_pool_freed_right_after_its_first_batch_lets_its_helpers_go(tmp_path: Path) -> None:
    """A helper thread that starts only after the batch that made it has returned and its pool is being freed must
    still see the stop (it once waited for an epoch that would never change again, and azyx_pool_free's join with it
    hung a process at exit: a bench script's child under CI's load). 2000 pools, each made, used once and freed."""
    src = tmp_path / "driver.c"
    src.write_text("#define _GNU_SOURCE\n" + files("azyx.backends").joinpath("c_runtime.c").read_text() + DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(["gcc", "-O2", "-pthread", str(src), "-o", str(exe)], check=True, capture_output=True)
    proc = subprocess.run([str(exe), "2000"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"], proc.stdout  # every element was added to once per round
