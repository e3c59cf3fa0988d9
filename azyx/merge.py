"""Multi-output kernels: elementwise kernels over the same loops merge into one kernel that writes several buffers.

An optimiser step updates each parameter and its state with several elementwise kernels over the same elements
(Adam: m, v and p, each reading the same gradient). Merged, they are one launch that reads each input once, and a
value one of them writes is used by the others straight from the register it was computed in.

The pass runs on a plan's step list, after scheduling:
- kernels merge when they run on one device over global loops of the same sizes, with no reduce and no register
  tiles (the merged loop nest is the loop nest of each of them);
- a kernel joins a group only if no step since the group's last member reads what the group writes: the group runs
  where its last member was, so everything it writes is written before anyone else reads it;
- a kernel that reads what its group writes must read it at the index the group writes it (then it takes the value
  itself): under another index it would read another loop iteration's result.
"""

from __future__ import annotations

from collections.abc import Callable

from azyx.codegen.launch import Launch
from azyx.dtypes import DType
from azyx.ir import Kernel, V, ValueBuilder, has_index, toposort
from azyx.plan import KernelStep, Step, TransferStep
from azyx.symbolic import Cond, Div, Lin, Mod, Var, lin_vars, var

MAX_PARAMS = 32  # buffers one merged kernel may take (OpenCL guarantees 1 KiB of kernel arguments: 128 pointers)

Render = Callable[[str, Kernel], tuple[str, str, Launch]]  # (device, kernel) -> (name, source, launch)


def merge_kernels(steps: list[Step], render: Render, max_buffers: Callable[[str], int] = lambda device: 0
                  ) -> list[Step]:
    """The steps with mergeable kernels merged into multi-output kernels (see the module docstring). `max_buffers`:
    the bindings a kernel may have on a device (0: no limit but MAX_PARAMS); a scalar words buffer takes one."""
    out: list[Step | _Group | None] = []
    groups: list[_Group] = []  # open ones: a later kernel may still join
    for st in steps:
        # (a kernel that writes part of its output reads the rest: the kernels that wrote it stay before it)
        reads = (st.src,) if isinstance(st, TransferStep) else st.args if st.kernel.inplace else st.args[st.outs:]
        joined: _Group | None = None
        if isinstance(st, KernelStep) and _mergeable(st.kernel):
            sizes = tuple(v.vmax + 1 for v in st.kernel.gvars)
            # a group whose results it reads first (they come from registers then), else the latest one
            for g in sorted((g for g in groups if g.device == st.device and g.sizes == sizes),
                            key=lambda g: (not g.written.keys() & set(reads), -g.pos)):
                if g.add(st):
                    joined = g
                    break
        for g in groups:  # a group read by another step cannot move past it any more
            if g is not joined and g.written.keys() & set(reads):
                g.closed = True
        groups = [g for g in groups if not g.closed]
        if joined is not None:
            out[joined.pos] = None
            joined.pos = len(out)
            out.append(joined)
        elif isinstance(st, KernelStep) and _mergeable(st.kernel):
            limit = max_buffers(st.device)
            g = _Group(st, len(out), min(MAX_PARAMS, limit - 1) if limit else MAX_PARAMS)
            out.append(g)
            groups.append(g)
        else:
            out.append(st)
    return [s.step(render) if isinstance(s, _Group) else s for s in out if s is not None]


def _mergeable(k: Kernel) -> bool:
    # (a gather's addresses name the values of their own kernel: they stay in it)
    return not k.uvars and not any(v.has_reduce for v in k.values) and not has_index(k)


class _Group:
    """Kernels merging into one; while it grows, its loads name slots (not parameters)."""

    def __init__(self, first: KernelStep, pos: int, max_params: int):
        self.device, self.pos, self.closed, self.max_params = first.device, pos, False, max_params
        self.gvars = first.kernel.gvars
        self.sizes = tuple(v.vmax + 1 for v in self.gvars)
        self.vb = ValueBuilder()
        self.members: list[KernelStep] = []
        self.stores: list[tuple[int, Lin, V]] = []  # (slot, index, value)
        self.written: dict[int, tuple[Lin, V]] = {}
        self.dtypes: dict[int, DType] = {}
        added = self.add(first)
        assert added

    def add(self, st: KernelStep) -> bool:
        k = st.kernel
        if self.members and len(set(self.dtypes) | set(st.args)) > self.max_params:
            return False
        vmap = dict(zip(k.gvars, self.gvars))

        def load(v: V) -> V | None:
            param, idx, cond = v.arg
            slot = st.args[param]
            idx, cond = _subst(idx, vmap), _subst_cond(cond, vmap)
            if slot not in self.written:
                return self.vb.load(slot, v.dtype, idx, cond)
            # the group's own value, read where it is written; a float stored narrower than it is computed (float16)
            # reads back rounded, so those stay apart
            widx, wv = self.written[slot]
            if widx.key != idx.key or not cond.always or (v.dtype.is_float and v.dtype.itemsize < 4):
                return None
            return wv

        values = rebuild(k.values, self.vb, load, vmap)
        if values is None:
            return False
        for i, ((idx, _), v) in enumerate(zip(k.stores, values)):
            slot = st.args[i]
            self.stores.append((slot, _subst(idx, vmap), v))
            self.written[slot] = self.stores[-1][1:]
        for i, slot in enumerate(st.args):
            self.dtypes[slot] = k.params[i]
        self.members.append(st)
        return True

    def step(self, render: Render) -> KernelStep:
        if len(self.members) == 1:
            return self.members[0]
        outs = [slot for slot, _, _ in self.stores]
        loads = [v for v in toposort(*(v for _, _, v in self.stores)) if v.op == "load"]
        ins = list(dict.fromkeys(v.arg[0] for v in loads))
        param = {slot: i for i, slot in enumerate(outs + ins)}
        vb = ValueBuilder()
        values = rebuild([v for _, _, v in self.stores], vb, lambda v: vb.load(param[v.arg[0]], v.dtype, *v.arg[1:]))
        assert values is not None
        k = Kernel([self.dtypes[s] for s in outs + ins], self.gvars, [],
                   [(idx, v) for (_, idx, _), v in zip(self.stores, values)], sum(m.work for m in self.members))
        name, src, launch = render(self.device, k)
        return KernelStep(self.device, name, src, tuple(outs + ins), k.work, k, outs=len(outs), launch=launch)


def rebuild(roots: list[V], vb: ValueBuilder, load: Callable[[V], V | None], vmap: dict[Var, Var] | None = None
            ) -> list[V] | None:
    """The values `roots` interned in `vb` over the loop variables `vmap` names (old -> new), each load replaced by
    `load(it)` (which maps its own index); None where a load gives None."""
    new: dict[int, V] = {}
    for v in toposort(*roots):
        if v.op == "load":
            got = load(v)
            if got is None:
                return None
        elif v.op == "const":
            got = vb.const(v.arg, v.dtype)
        elif v.op == "arg":
            got = vb.arg(v.arg, v.dtype)
        elif v.op == "cond":
            got = vb.cond(v.arg if vmap is None else _subst_cond(v.arg, vmap), v.dtype)
        elif v.op == "alu":
            got = vb.alu(v.arg, v.dtype, *(new[id(s)] for s in v.src))
        elif v.op == "cast":
            got = vb.cast(new[id(v.src[0])], v.dtype)
        elif v.op == "where":
            got = vb.where(*(new[id(s)] for s in v.src))
        else:
            raise AssertionError(f"cannot merge a kernel with a {v.op}")
        new[id(v)] = got
    return [new[id(r)] for r in roots]


def _subst(x: Lin, vmap: dict[Var, Var]) -> Lin:
    """`x` over other loop variables (vmap: old -> new)."""
    if all(vmap[v] is v for v in lin_vars(x)):
        return x
    out = Lin({}, x.const)
    for a, c in x.terms.items():
        if isinstance(a, Var):
            out = out + var(vmap[a]) * c
        elif isinstance(a, Div):
            out = out + (_subst(a.x, vmap) // a.n) * c
        else:
            assert isinstance(a, Mod)
            out = out + (_subst(a.x, vmap) % a.n) * c
    return out


def _subst_cond(c: Cond, vmap: dict[Var, Var]) -> Cond:
    return c if not c.facts else Cond(tuple((_subst(x, vmap), lo, hi) for x, lo, hi in c.facts), c.never)
