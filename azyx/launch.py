"""How a kernel is launched, decided once, when it is rendered: the `Launch` record that each KernelStep carries and
each backend reads as it is (grid and group for GPU-style APIs; the shared loop's trip count and the parallel kind for
host kernels). Launch geometry is a fact of the kernel and its dialect, never re-derived at launch."""

from __future__ import annotations

from dataclasses import dataclass

from azyx import attention, gemm, gemm_host, gemm_sm90
from azyx.cstyle import (
    SERIAL,
    SHARED,
    Dialect,
    group_size,
    kernel_name,
    parallel_kind,
    parallel_loop,
    render,
    vectorized,
    work_group,
)
from azyx.ir import Kernel, attention_of


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int] = (1, 1, 1)  # work groups (CUDA blocks) per dimension
    group: int = 1  # work items per group
    trip: int = 0  # a host kernel's shared loop: its iterations, which the device's threads share out
    parallel: int = SERIAL  # a host kernel's cstyle parallel kind: SERIAL, SHARED or OWN_REGION
    zero: int = 0  # bytes of the first output to zero before the kernel runs (a product whose K is split over groups)
    smem: int = 0  # CUDA: bytes of dynamic shared memory per block
    maps: tuple[gemm_sm90.TensorMap, ...] = ()  # CUDA: TMA tensor maps, the kernel's parameters after its buffers

    @property
    def items(self) -> int:
        """Work items in all (OpenCL's global size)."""
        return self.grid[0] * self.grid[1] * self.grid[2] * self.group


def render_kernel(k: Kernel, dl: Dialect, threads: int = 1, sm90: int = 0) -> tuple[str, str, Launch]:
    """(name, source, launch) of a kernel: the tiled matrix product where the dialect has it and `k` is one, else the
    generic C-family rendering. The name hashes the source, so kernels of one source are one program (their launches
    may still differ: a row-sum's rows, a product's batch, a shared loop's trip count are not in the source).
    `sm90`: the multiprocessors of a CUDA device of compute capability 9.0 (0: none), whose float16/bfloat16 products
    take azyx.gemm_sm90's kernel where they fit (unless a searched tile, Kernel.variant, asks for mma.sync's)."""
    a = attention_of(k)
    if a is not None:  # (the scheduler makes one only where the dialect has the kernel: attention.fits)
        src = attention.render(k, a, "KERNEL", dl)
        name = kernel_name(src)
        launch = (Launch(attention.cuda_grid(a), attention.CUDA_THREADS) if dl.global_ids else
                  Launch(trip=attention.parts(a), parallel=SHARED))  # (its signature takes lo, hi: always SHARED)
        return name, src.replace("KERNEL", name, 1), launch
    g = product_of(k, dl, threads)
    if g is not None and sm90 and g.mma and gemm_sm90.fits(g) and not g.variant:  # (a searched tile: mma.sync's)
        src = gemm_sm90.render(g, "KERNEL")
        name = kernel_name(src)
        launch = Launch(gemm_sm90.grid(g, sm90), gemm_sm90.THREADS, smem=gemm_sm90.smem_bytes(g),
                        maps=gemm_sm90.tensor_maps(g))
        return name, src.replace("KERNEL", name, 1), launch
    body = None
    if g is not None and g.target == "c":
        body = gemm_host.render_c(g, "KERNEL", dl.types[g.dtype])
    elif g is not None and g.target == "cl":
        body = gemm_host.render_cl(g, "KERNEL")
    elif g is not None:
        body = gemm.render_glsl(g, "KERNEL", dl.prelude, dl.max_groups) if dl.glsl else gemm.render_cuda(g, "KERNEL")
        g = g if body is not None else None
    if body is None:
        body = render(k, "KERNEL", dl, threads)
    name = kernel_name(body)
    return name, body.replace("KERNEL", name, 1), launch_for(k, dl, threads, g)


def product_of(k: Kernel, dl: Dialect, threads: int = 1) -> gemm.Gemm | None:
    """The matrix product `k` computes where `dl` has a template for it (azyx.gemm on GPU dialects, azyx.gemm_host on
    host ones) and the template takes it, else None (the generic C-family rendering)."""
    if not dl.gemm:
        return None
    target = product_target(dl)
    if target == "cl":
        return gemm_host.product_cl(k, dl.simd)
    if dl.global_ids:
        return gemm.match(k, target, dl.tensor_cores)
    return gemm_host.product(k, dl.simd, threads, dl.bf16_dot)


def product_target(dl: Dialect) -> str:
    """The `gemm.match` target of a dialect with a product template: "c" on the host, "glsl" for Vulkan, "cl" for
    OpenCL (whose devices have the template on a CPU only: OpenCLDevice), else "cuda"."""
    return "c" if not dl.global_ids else "glsl" if dl.glsl else "cl" if dl.name == "opencl" else "cuda"


def launch_for(k: Kernel, dl: Dialect, threads: int = 1, g: gemm.Gemm | None = None) -> Launch:
    if g is not None and g.target == "c":  # blocks of C shared by the device's threads (one: a single call)
        return Launch(trip=gemm_host.trip(g), parallel=SHARED)
    if g is not None and g.target == "cl":  # a work group of one item per tile of C
        return Launch((gemm_host.cl_items(g), 1, 1), 1)
    if g is not None:
        return Launch(g.grid(), g.threads, zero=4 * g.m * g.n * g.batch if g.split[0] > 1 else 0)
    if not dl.global_ids:  # host: the kernel loops itself; threads may share one of its loops
        loop = parallel_loop(k, dl, threads)
        return Launch(trip=0 if loop is None else k.gvars[loop].vmax + 1, parallel=parallel_kind(k, dl, threads))
    n = max(k.global_size, 1)
    group = work_group(k, dl)
    if group_size(k, dl):  # a group per output point (a warp per point: several points per group)
        groups = -(-n // (group // dl.warp)) if dl.warp and group_size(k, dl) == dl.warp else n
    else:  # one work item per point (several, vectorised)
        groups = -(-(n // (vectorized(k, dl) or 1)) // group)
    if dl.max_groups and groups > dl.max_groups:  # too many for one dimension: rows of max_groups
        return Launch((dl.max_groups, -(-groups // dl.max_groups), 1), group)
    return Launch((groups, 1, 1), group)
