"""Code generation: from a kernel of the IR (azyx.ir.Kernel) to source text and a launch.

- `dialect`: one row per language (C, OpenCL C, CUDA C, GLSL, WGSL), the facts and capabilities everything here reads;
  `preludes`: each language's helper code.
- `launch`: the `Launch` record and the analysis that decides it (grouped reductions, vector widths, host threads).
- `render`: the emitter the renderers share; `cfamily`: the C-family renderer (C, OpenCL, CUDA, GLSL), `cexpr` its
  spelling of values; `wgsl`: WGSL's renderer, `wgsl_expr` its spelling of values.
- `templates`: hand-shaped kernels for what the generic renderer does slowly: matrix products (`gemm`: matching and
  tiles; `gemm_cuda`, `gemm_glsl`, `gemm_host`, `gemm_sm90`: one family each) and fused attention (`attention`: the
  facts the planner asks and the host kernel; `attention_cuda`: CUDA's kernels).
- `kernel`: `render_kernel`, which picks the template or the generic renderer for a kernel.
- `search_actions`: what a search may change in a kernel (`Opt`), applied to the IR, and the winners' cache.
"""
