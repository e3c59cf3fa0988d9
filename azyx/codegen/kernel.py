"""A kernel's source and launch for a C-family dialect: the template that takes it (fused attention, a product
template of the dialect's family) or else the generic rendering (codegen.cfamily). The one place that picks."""

from __future__ import annotations

from azyx.codegen import cfamily, cgemv
from azyx.codegen.dialect import BLOCKED, ITEM_TILES, SHADER_TILES, Dialect
from azyx.codegen.launch import SHARED, Launch, launch_for
from azyx.codegen.render import kernel_name
from azyx.codegen.templates import attention, attention_cuda, gemm, gemm_cuda, gemm_glsl, gemm_host, gemm_sm90, gemv
from azyx.codegen.templates.attention_decode import render as render_decode
from azyx.dtypes import DType
from azyx.ir import Attention, Kernel, attention_of


def render_kernel(k: Kernel, dl: Dialect, threads: int = 1, sm90: int = 0) -> tuple[str, str, Launch]:
    """(name, source, launch) of a kernel: the tiled matrix product where the dialect has it and `k` is one, else the
    generic C-family rendering. The name hashes the source, so kernels of one source are one program (their launches
    may still differ: a row-sum's rows, a product's batch, a shared loop's trip count are not in the source).
    `sm90`: the multiprocessors of a CUDA device of compute capability 9.0 (0: none), whose float16/bfloat16 products
    take templates.gemm_sm90's kernel where they fit (unless a searched tile, Kernel.variant, asks for mma.sync's)."""
    a = attention_of(k)
    if a is not None:  # (the scheduler makes one only where the dialect has the kernel: attention.fits)
        src = _attention_source(k, a, dl)
        name = kernel_name(src)
        return name, src.replace("KERNEL", name, 1), _attention_launch(a, dl, k.params)
    v = small_product(k, dl)
    if v is not None:
        src = cgemv.render(k, v, "KERNEL", dl)
        name = kernel_name(src)
        return name, src.replace("KERNEL", name, 1), Launch(v.grid(dl.max_groups), v.threads)
    g = product_of(k, dl, threads)
    if g is not None and sm90 and g.mma and gemm_sm90.fits(g) and not g.variant:  # (a searched tile: mma.sync's)
        src = gemm_sm90.render(g, "KERNEL")
        name = kernel_name(src)
        launch = Launch(gemm_sm90.grid(g, sm90), gemm_sm90.THREADS, smem=gemm_sm90.smem_bytes(g),
                        maps=gemm_sm90.tensor_maps(g))
        return name, src.replace("KERNEL", name, 1), launch
    body = None if g is None else _product_source(g, dl)
    if body is None:
        g = None
        body = cfamily.render(k, "KERNEL", dl, threads)
    name = kernel_name(body)
    return name, body.replace("KERNEL", name, 1), launch_for(k, dl, threads, g)


def _attention_launch(a: Attention, dl: Dialect, params: list[DType]) -> Launch:
    """The attention kernel's launch: the host's parts (its signature takes lo, hi: always SHARED); OpenCL's decode
    form a work item per part; CUDA's grid of CUDA_THREADS blocks, with the dynamic shared memory of its whole
    kernels."""
    if not dl.global_ids:
        return Launch(trip=attention.parts(a), parallel=SHARED)
    if not attention.decode_lanes(dl):
        return Launch((-(-attention.parts(a) // OPENCL_ITEMS), 1, 1), OPENCL_ITEMS)
    smem = 0
    if not a.splits:
        mma = attention_cuda.mma_fits(a, dl, params)
        smem = attention_cuda.mma_smem_bytes(a) if mma else attention_cuda.cuda_smem(a)
    return Launch(attention.cuda_grid(a), attention.CUDA_THREADS, smem=smem)


OPENCL_ITEMS = 64  # work items per group of OpenCL's decode kernel


def _attention_source(k: Kernel, a: Attention, dl: Dialect) -> str:
    """Attention kernel `k` (spec `a`) in dialect `dl`: a stage of the decode form where `a` is one, else CUDA's on
    tensor cores where they take it, its float32 kernel, or the host's; its scale is scalar parameter sc0, or a
    literal."""
    s = k.stores[0][1].src[0]
    scale = "sc0" if s.op == "arg" else repr(float(s.arg))
    if a.splits:  # the decode form's stage
        return render_decode(a, "KERNEL", dl, k.params, scale)
    if dl.global_ids:
        if attention_cuda.mma_fits(a, dl, k.params):
            return attention_cuda.render_mma(a, "KERNEL", dl, k.params, scale)
        return attention_cuda.render_cuda(a, "KERNEL", dl, k.params, scale)
    return attention.render_c(a, "KERNEL", dl, k.params, scale)


def _product_source(g: gemm.Gemm, dl: Dialect) -> str | None:
    """Product `g` by its template family's kernel (None: the GLSL template does not take it)."""
    if g.target == BLOCKED:
        return gemm_host.render_c(g, "KERNEL", dl.types[g.dtype])
    if g.target == ITEM_TILES:
        return gemm_host.render_cl(g, "KERNEL")
    if g.target == SHADER_TILES:
        return gemm_glsl.render_glsl(g, "KERNEL", dl.prelude, dl.max_groups)
    return gemm_cuda.render_cuda(g, "KERNEL")


def small_product(k: Kernel, dl: Dialect) -> gemv.Gemv | None:
    """The small-M product (with its fused prologue and epilogue) that `k` computes where `dl` has the kernel for it
    (Dialect.small_products), else None."""
    return gemv.match(k) if dl.small_products and not k.rows else None


def templated(k: Kernel, dl: Dialect, threads: int = 1) -> bool:
    """Whether a template renders product `k` on `dl` (a small-M product's, or the dialect's product family's): it
    reads its operands where they lie, so the scheduler tiles nothing for it."""
    return small_product(k, dl) is not None or product_of(k, dl, threads) is not None


def product_of(k: Kernel, dl: Dialect, threads: int = 1) -> gemm.Gemm | None:
    """The matrix product `k` computes where `dl` has a template for it (its `products` family) and the template
    takes it, else None (the generic C-family rendering)."""
    if not dl.gemm or k.rows:
        return None
    if dl.products == ITEM_TILES:
        return gemm_host.product_cl(k, dl.simd)
    if dl.products == BLOCKED:
        return gemm_host.product(k, dl.simd, threads, dl.bf16_dot)
    return gemm.match(k, dl.products, dl.tensor_cores)
