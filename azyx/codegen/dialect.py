"""The dialects code is generated in: one row per language (C, OpenCL C, CUDA C, GLSL, WGSL), each the facts that the
shared emitter, the launch analysis and the templates read. A device asks for what it can do through its row's fields
(product template family, tensor cores, subgroup shuffles, vector types, block search), never by the row's name.

Product template families (`Dialect.products`, azyx.codegen.templates): BLOCKED, the host's packed blocks shared by
threads (gemm_host.render_c); ITEM_TILES, a work item per tile of C for OpenCL on a CPU (gemm_host.render_cl);
WARP_TILES, CUDA's shared-memory tiles with warp tiles, tensor cores and split K (templates.gemm_cuda, gemm_sm90);
SHADER_TILES, the same scheme as a Vulkan compute shader without float atomics (templates.gemm_glsl)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from azyx.codegen.preludes import C_PRELUDE, C_STREAM, CL_PRELUDE, CUDA_PRELUDE, GLSL_PRELUDE
from azyx.dtypes import DType, dtypes

BLOCKED, ITEM_TILES, WARP_TILES, SHADER_TILES = "blocked", "item_tiles", "warp_tiles", "shader_tiles"
PRODUCT_FAMILIES = (BLOCKED, ITEM_TILES, WARP_TILES, SHADER_TILES)


@dataclass(frozen=True)
class Dialect:
    name: str
    kernel_prefix: str
    buffer_qual: str
    restrict: str
    index_type: str
    types: dict[str, str]
    fn_suffix_f32: str  # math functions on float: "f" for C's expf, "" where names are overloaded
    prelude: str
    pragmas: bool  # OpenMP pragmas for host loops
    guarded_prefix: str = ""  # before kernels whose loads are guarded by index conditions (pads)
    global_ids: str = ""  # GPU-style: the expression of a work item's linear id; global loops become index math
    # hides a value from the optimiser ({x}): gcc turns the register-tiled reduce loop of a matmul into slow code
    # for some constant trip counts (18 instead of 270 GFLOP/s at K=784); an opaque bound keeps the fast form
    opaque: str = ""
    compute_types: dict[str, str] = field(default_factory=dict)  # where the compute type differs from storage
    # per storage dtype: how to load ({buf}, {idx}), store ({buf}, {idx}, {val}) and round to it ({x})
    loads: dict[str, str] = field(default_factory=dict)
    stores: dict[str, str] = field(default_factory=dict)
    rounds: dict[str, str] = field(default_factory=dict)
    narrow_index: str = ""  # a 32-bit index type for kernels whose indices fit (64-bit division is slow on GPUs)
    # grouped reductions: work-group size (0: none), group and local id, shared-memory qualifier, barrier
    group_size: int = 0
    block: int = 0  # GPU-style: work items per group of a kernel with one work item per output point
    gemm: bool = False  # matrix products get the dialect's product template (`products`)
    # which product template family the dialect's kernels take (azyx.codegen.templates; PRODUCT_FAMILIES)
    products: str = ""
    tensor_cores: bool = False  # ... and float16/bfloat16 products its tensor-core kernel (CUDA: mma.sync, sm_80 on)
    # products of a few rows (templates.gemv.GEMV_ROWS), their fused prologue and epilogue with them, get the small-M
    # kernel (codegen.cgemv: a block per slab of columns, 16-byte weight loads)
    gemv: bool = False
    bounds: str = ""  # after the kernel prefix: the block size {n} a kernel is launched with (CUDA: its registers)
    align: str = ""  # before a shared array's declaration: its alignment {n} in bytes (read through cast pointers)
    attention: bool = False  # attention is one kernel of codegen.templates.attention (else its composed form runs)
    decode: bool = False  # a decode step's attention (templates.attention_decode) is a kernel even without `attention`
    simd: int = 16  # host: vector register width in bytes (the C device's ISA: 32 AVX2, 64 AVX-512: gemm_host)
    bf16_dot: bool = False  # host: the compiler targets AVX-512 BF16 (vdpbf16ps), for bfloat16 products (gemm_host)
    group_ids: tuple[str, str] = ("", "")
    shared: str = ""
    barrier: str = ""
    unroll: str = ""  # before a strided reduce loop, so several loads are in flight per work item
    shuffle: str = ""  # a warp's butterfly shuffle of {x} with lane ^ {o} (32 lanes): no barrier inside a warp
    warp: int = 0  # with `shuffle`: where outputs are many, a warp (not a whole group) reduces each output
    warp_outputs: int = 4096  # ... from this many outputs on
    # a reduce read along its outputs (a column sum) with a few thousand outputs runs in two stages, partial rows first
    # (schedule.column_parts): one work item per output walking its column leaves most of a GPU idle
    split_columns: bool = False
    # a vector of {n} floats: float32 kernels may move `vector_width` elements (2 or 4; 0: none unless the kernel asks,
    # Kernel.vector) per load and store; `vector_load`/`vector_store`: at {ptr} where a cast pointer will not do
    vector: str = ""
    vector_width: int = 0
    vector_load: str = ""
    vector_store: str = ""
    # streaming stores (codegen.launch.streams): C defining AZYX_NT (floats a store), AZYX_NT_STORE(p, t) (store the
    # AZYX_NT floats at t to p, p aligned to them) and AZYX_NT_FENCE() (orders them before the kernel returns)
    stream: str = ""
    copies: int = 1  # a grouped reduce's steps per loop iteration (where the dialect has no unroll pragma: GLSL)
    max_trips: int = 0  # a driver's bound on a shader's loop iterations (llvmpipe stops loops silently past 65535)
    # integer max/min as azyx_max/azyx_min of the prelude: NVRTC (CUDA 13) miscompiles `(-x > acc ? -x : acc)` in
    # an unrolled reduce that starts at INT_MIN (max(-x, c) rewritten as -min(x, -c)); an asm max is opaque to it
    int_minmax: bool = False
    cast: str = "(({t}){x})"  # a conversion of {x} to type {t}
    fns: dict[str, str] = field(default_factory=dict)  # math functions under another name (GLSL: fabs is abs)
    int64_suffix: str = "LL"
    double_suffix: str = ""  # (GLSL: an unsuffixed literal is a float)
    glsl: bool = False  # buffers are addresses and scalars words of a words buffer, shared memory is global, entry main
    bools: tuple[str, str] = ("0", "1")  # false, true
    # row kernels (ir.Kernel.rows): an elementwise kernel that reads statistics of its own rows (a layernorm's mean and
    # variance, a softmax's maximum and sum) is one kernel of a work group per row, where the dialect has grouped
    # reductions (group_size)
    rows: bool = False
    max_groups: int = 0  # work groups per grid dimension (0: no limit); a longer grid folds into the next dimension

    @property
    def block_search(self) -> bool:
        """Whether the search may pick block sizes (search_actions.BLOCK) of the dialect's product template: where it
        has one with a table of them (the host's block sizes, CUDA's and Vulkan's tiles; not OpenCL's CPU template)."""
        return self.gemm and self.products in (BLOCKED, WARP_TILES, SHADER_TILES)

    @property
    def small_products(self) -> bool:
        """Whether products of a few rows get the small-M kernel (codegen.cgemv): where the dialect asks (`gemv`) and
        its shuffles, if any, are of the kernel's 32 lanes (a subgroup of 8 or 64: the generic kernels)."""
        return self.gemv and (not self.shuffle or self.warp == 32)

    def ctype(self, d: DType) -> str:
        return self.types[d.name]

    def compute_type(self, d: DType) -> str:
        if d in (dtypes.float16, dtypes.bfloat16):
            return self.types["float32"]
        return self.compute_types.get(d.name) or self.types[d.name]


C = Dialect(
    name="c",
    kernel_prefix="void",
    buffer_qual="",
    restrict="restrict",
    index_type="long",
    types={"bool": "_Bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "int32": "int",
           "uint32": "unsigned int", "int64": "long long", "float16": "_Float16", "bfloat16": "bf16_t",
           "float32": "float", "float64": "double"},
    fn_suffix_f32="f",
    prelude=C_PRELUDE,
    stream=C_STREAM,
    pragmas=True,
    gemm=True,
    opaque='__asm__("" : "+r"({x}));',
    loads={"float16": "(float){buf}[{idx}]", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "{buf}[{idx}] = (_Float16){val};", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "((float)(_Float16){x})", "bfloat16": "bf2f(f2bf((float){x}))"},
    # gcc 12.2 vectorises loop nests whose loads are guarded by range tests on an outer loop index wrongly (whole
    # rows read as zeros) under its default cost model; the cheapest model compiles them right
    guarded_prefix='__attribute__((optimize("vect-cost-model=very-cheap"))) ',
    attention=True,
    products=BLOCKED,
)

OPENCL = Dialect(
    name="opencl",
    kernel_prefix="__kernel void",
    buffer_qual="__global ",
    restrict="restrict",
    index_type="long",
    types={"bool": "uchar", "int8": "char", "uint8": "uchar", "int16": "short", "int32": "int", "uint32": "uint",
           "int64": "long", "float16": "half", "bfloat16": "ushort", "float32": "float", "float64": "double"},
    fn_suffix_f32="",
    prelude=CL_PRELUDE,
    pragmas=False,
    global_ids="get_global_id(0)",
    block=64,  # a multiple of every SIMD width seen
    compute_types={"bool": "bool"},
    loads={"float16": "vload_half({idx}, {buf})", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "vstore_half({val}, {idx}, {buf});", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "f16r({x})", "bfloat16": "bf2f(f2bf((float){x}))"},
    narrow_index="int",
    group_size=64,
    group_ids=("get_group_id(0)", "get_local_id(0)"),
    shared="__local",
    barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    vector="float{n}",  # (none by default: PoCL vectorises work items itself; the search may try it)
    vector_load="vload{n}(0, {ptr})",
    vector_store="vstore{n}({val}, 0, {ptr});",
    decode=True,
    products=ITEM_TILES,
    rows=True,
)

CUDA = Dialect(
    name="cuda",
    kernel_prefix='extern "C" __global__ void',
    buffer_qual="",
    restrict="__restrict__",
    index_type="long long",
    types={"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "int32": "int",
           "uint32": "unsigned int", "int64": "long long", "float16": "f16_t", "bfloat16": "bf16_t",
           "float32": "float", "float64": "double"},
    fn_suffix_f32="f",
    prelude=CUDA_PRELUDE,
    pragmas=False,
    global_ids="((long long)blockIdx.x*blockDim.x+threadIdx.x)",
    block=256,
    gemm=True,
    tensor_cores=True,  # (a device older than sm_80 turns it off)
    gemv=True,
    bounds=" __launch_bounds__({n})",
    align="__align__({n}) ",
    attention=True,
    loads={"float16": "h2f({buf}[{idx}])", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"float16": "{buf}[{idx}] = f2h({val});", "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "h2f(f2h({x}))", "bfloat16": "bf2f(f2bf((float){x}))"},
    narrow_index="int",
    group_size=256,
    group_ids=("blockIdx.x", "threadIdx.x"),
    shared="__shared__",
    barrier="__syncthreads();",
    unroll="#pragma unroll 8",
    shuffle="__shfl_xor_sync(0xffffffffu, {x}, {o})",
    warp=32,
    split_columns=True,
    vector="float{n}",
    vector_width=4,
    int_minmax=True,
    products=WARP_TILES,
    rows=True,
)

GLSL = Dialect(
    name="glsl",
    kernel_prefix="",
    buffer_qual="",
    restrict="",
    index_type="int64_t",
    types={"bool": "uint8_t", "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "int32": "int",
           "uint32": "uint", "int64": "int64_t", "float16": "float16_t", "bfloat16": "uint16_t", "float32": "float",
           "float64": "double"},
    fn_suffix_f32="",
    prelude=GLSL_PRELUDE,
    pragmas=False,
    global_ids="gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x",
    block=64,
    gemm=True,
    vector="vec{n}",
    vector_width=4,
    compute_types={"bool": "bool"},
    loads={"bool": "({buf}[{idx}]!=uint8_t(0))", "float16": "float({buf}[{idx}])", "bfloat16": "bf2f({buf}[{idx}])"},
    stores={"bool": "{buf}[{idx}] = uint8_t({val});", "float16": "{buf}[{idx}] = float16_t({val});",
            "bfloat16": "{buf}[{idx}] = f2bf({val});"},
    rounds={"float16": "f16r(float({x}))", "bfloat16": "bf2f(f2bf(float({x})))"},
    narrow_index="int",
    group_size=64,
    group_ids=("(gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x)", "gl_LocalInvocationID.x"),
    shared="shared",
    barrier="memoryBarrierShared(); barrier();",
    cast="{t}({x})",
    fns={"fabs": "abs", "rint": "roundEven", "fmod": "azyx_fmod", "copysign": "azyx_copysign", "log1p": "azyx_log1p",
         "erf": "azyx_erf", "pow": "azyx_pow", "exp": "azyx_exp", "log": "azyx_log", "exp2": "azyx_exp2",
         "log2": "azyx_log2", "sin": "azyx_sin", "cos": "azyx_cos", "tan": "azyx_tan", "tanh": "azyx_tanh"},
    int64_suffix="l",
    double_suffix="lf",
    glsl=True,
    bools=("false", "true"),
    max_groups=65535,
    products=SHADER_TILES,
    rows=True,
)

LLVMPIPE_TRIPS = 60000  # (llvmpipe ends a shader's loops after 65535 iterations, silently: a margin below it)


@functools.cache
def glsl_dialect(preserve_nan: tuple[int, ...], gemm: bool, warp: int) -> Dialect:
    """The GLSL dialect for one device:
    - with the float widths whose signed zeros, infinities and NaNs the device keeps when a shader asks (SPIR-V's
      SignedZeroInfNanPreserve): without it a driver may fold `x != x` to false and -0.0 to 0.0 (NVIDIA's does), and
      NaN propagation and the signs of zeros would be lost;
    - with `gemm` (a GPU's), matrix products in the shared-memory tiled shader of azyx.gemm and those of a few rows in
      the small-M kernel (codegen.cgemv) (on a CPU, lavapipe, register tiles of the generic renderer run 3x faster
      than it; see the Vulkan backend's VulkanDevice.tiles), work groups of 256 items, and four steps
      of a grouped reduce per loop iteration (GLSL has no unroll pragma: loads in flight);
    - with `warp` (a subgroup's lanes, which shuffle), reductions combine within a subgroup by butterfly shuffles (no
      shared memory, no barrier), as CUDA's warps do."""
    head = "#version 450\n"
    assert GLSL.prelude.startswith(head)
    mode = 'spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, {});\n'
    extra = "#extension GL_EXT_spirv_intrinsics : require\n" if preserve_nan else ""
    extra += "".join(mode.format(w) for w in preserve_nan)
    if warp:
        extra += "#extension GL_KHR_shader_subgroup_shuffle : require\n"
    group = 256 if gemm else GLSL.block  # (CUDA's size on a GPU; lavapipe's threads prefer 64)
    if warp:  # a group's subgroups' results are combined by one subgroup
        group = min(group, warp * warp)
    return replace(GLSL, prelude=head + extra + GLSL.prelude[len(head):], gemm=gemm, gemv=gemm, warp=warp,
                   shuffle="subgroupShuffleXor({x}, {o})" if warp else "", block=group,
                   group_size=group, copies=4 if gemm else 1, max_trips=0 if gemm else LLVMPIPE_TRIPS)


# the launch facts of WGSL kernels (launch.launch_for and the scheduler read these; its text is codegen.wgsl's, its
# dtypes WGSL_TYPES)
WGSL = Dialect(name="wgsl", kernel_prefix="", buffer_qual="", restrict="", index_type="i32", types={},
               fn_suffix_f32="", prelude="", pragmas=False, global_ids="gid", block=64, group_size=64, rows=True,
               max_groups=65535, vector_width=4)  # (the width wgsl.WGSL_VEC renders by default: the search's base)


@dataclass(frozen=True)
class WType:
    """How one dtype lives in WGSL: the type it is computed in, the element type of its storage array, how many
    elements share a 32-bit word (1: stored as is), the adapter feature it needs, and (packed types) how a stored
    element `{x}` (u32) becomes a value and a value `{x}` becomes its stored bits, and how a computed value is rounded
    or wrapped to the dtype after each op."""

    compute: str
    storage: str
    pack: int = 1
    feature: str = ""
    unpack: str = "{x}"
    packs: str = "{x}"
    rounds: str = ""

    @property
    def element_size(self) -> int:
        """Bytes of one element of its storage array (a packed type's: a 32-bit word)."""
        return 8 if self.storage in ("f64", "i64") else 4


WGSL_TYPES: dict[str, WType] = {
    "bool": WType("bool", "u32", 4, unpack="({x} != 0u)", packs="select(0u, 1u, {x})"),
    "int8": WType("i32", "u32", 4, unpack="wrap8(bitcast<i32>({x}))", packs="bitcast<u32>({x})",
                  rounds="wrap8({x})"),
    "uint8": WType("i32", "u32", 4, unpack="bitcast<i32>({x})", packs="bitcast<u32>({x})", rounds="({x} & 255)"),
    "int16": WType("i32", "u32", 2, unpack="wrap16(bitcast<i32>({x}))", packs="bitcast<u32>({x})",
                   rounds="wrap16({x})"),
    "int32": WType("i32", "i32"),
    "uint32": WType("u32", "u32"),
    "int64": WType("i64", "i64", feature="shader-int64"),
    "float16": WType("f32", "u32", 2, unpack="unpack2x16float({x}).x", packs="pack2x16float(vec2<f32>({x}, 0.0f))",
                     rounds="f16r({x})"),
    "bfloat16": WType("f32", "u32", 2, unpack="bitcast<f32>({x} << 16u)", packs="f2bf({x})", rounds="bf16r({x})"),
    "float32": WType("f32", "f32"),
    "float64": WType("f64", "f64", feature="shader-f64"),
}
