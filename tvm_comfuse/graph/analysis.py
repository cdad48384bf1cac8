"""Finding compute-memory fusion groups in a Relax dataflow block (graph -> group).

A group starts at a GEMM (``relax.matmul``, 2-D or batched) and grows forward, in binding
order, over every operator that (1) reads a tensor of the group, (2) keeps the GEMM's row
structure (its output is a ``rows x N`` tile or one statistic per row) and (3) reads no tensor
that itself depends on the group through an operator outside it. Rule (3) keeps the group
convex, so outlining it can never create a cycle; rules (1) and (2) are what the schedule
rules rely on (every block of the fused PrimFunc indexes the GEMM's rows).

The PyTorch ``linear`` form ``matmul(x, permute_dims(w))`` pulls the transpose in as a
prologue. Tensors of the group that are also read outside it become extra outputs of the
fused function (written once, never recomputed). Trailing reshapes are left outside (a
reshape outside is a free view, inside it would be a copy), and a group keeps a single sink
so that it is one dataflow pattern rooted at one binding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm
import tvm.sym
from tvm import relax

from . import ops
from .group import B2B_GEMM, GEMM_ELEMENTWISE, GEMM_REDUCE, FusionGroup, TensorInfo

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")

#: Widest GEMM intermediate (elements per row) that a back-to-back GEMM keeps on chip.
#: 256 fp16 columns x a 128-row tile is 64 KiB of shared memory, inside every sm_80+ budget.
B2B_MAX_INTERMEDIATE = 256

_CHAIN_ROLES = ("elementwise", "reduction", "norm", "reshape")


@dataclass
class _Candidate:
    """A group being grown: binding indices, their vars, and the GEMM's row geometry."""

    members: list
    rows: object
    width: object
    out_shape: tuple


def _shape(var) -> tuple | None:
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    if not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return tuple(ty.shape.values)


def _prod(dims):
    out = tvm.tirx.const(1, "int64")
    for d in dims:
        out = out * d
    return out


class _Block:
    """Use-def facts of one dataflow block that group formation needs."""

    def __init__(self, block: relax.DataflowBlock):
        self.bindings = list(block.bindings)
        self.index = {b.var: i for i, b in enumerate(self.bindings)}
        self.users = {b.var: [] for b in self.bindings}
        self.escapes = set()
        for i, b in enumerate(self.bindings):
            for v in relax.analysis.free_vars(b.value):
                if v in self.users:
                    self.users[v].append(i)
            if not isinstance(b.var, relax.DataflowVar):
                self.escapes.add(b.var)
        self.analyzer = tvm.sym.Analyzer()

    def call(self, i):
        value = self.bindings[i].value
        return value if isinstance(value, relax.Call) else None

    def var(self, i):
        return self.bindings[i].var

    def equal(self, a, b) -> bool:
        return self.analyzer.can_prove_equal(a, b)

    def row_shaped(self, cand: _Candidate, var) -> bool:
        """True if ``var`` is a rows x N tile or one value per row of the candidate's GEMM."""
        shape = _shape(var)
        if shape is None or len(shape) == 0:
            return False
        numel = _prod(shape)
        if self.equal(shape[-1], cand.width) and self.equal(numel, cand.rows * cand.width):
            return True
        if not self.equal(numel, cand.rows):
            return False
        per_row = tuple(cand.out_shape[:-1])
        return self.equal(shape[-1], 1) or (
            len(shape) == len(per_row) and all(self.equal(a, b) for a, b in zip(shape, per_row))
        )


def _anchor(blk: _Block, i: int, claimed: set) -> _Candidate | None:
    call = blk.call(i)
    if call is None or ops.op_name(call) != ops.GEMM or i in claimed:
        return None
    a, b = call.args
    out = _shape(blk.var(i))
    if out is None or len(out) < 2 or _shape(a) is None or _shape(b) is None:
        return None
    if len(_shape(b)) < 2:
        return None
    members = [i]
    producer = blk.index.get(b)
    if producer is not None and producer not in claimed:
        pcall = blk.call(producer)
        if (
            pcall is not None
            and ops.op_name(pcall) == ops.TRANSPOSE
            and ops.is_last_two_axes_swap(pcall)
            and blk.users[b] == [i]
            and b not in blk.escapes
        ):
            members.insert(0, producer)
    return _Candidate(members, _prod(out[:-1]), out[-1], out)


def _grow(blk: _Block, cand: _Candidate, claimed: set) -> None:
    inside = {blk.var(m) for m in cand.members}
    tainted = set()
    for j in range(cand.members[-1] + 1, len(blk.bindings)):
        call = blk.call(j)
        free = relax.analysis.free_vars(blk.bindings[j].value)
        reads_group = any(v in inside for v in free)
        if not reads_group and not any(v in tainted for v in free):
            continue
        role = ops.role_of(call) if call is not None else None
        ok = (
            reads_group
            and j not in claimed
            and not any(v in tainted for v in free)
            and role in _CHAIN_ROLES
            and blk.row_shaped(cand, blk.var(j))
            # a row reduction over one column is the value itself: nothing to compute on chip,
            # and fused, LLVM folded y - max(y) to 0 where y = -inf (CPU fuzz seed 685). Norm
            # operators stay (vanilla TVM cannot legalise a bf16 LayerNorm: seed 299)
            and not (role == "reduction" and blk.equal(cand.width, 1))
        )
        if ok and role == "reshape":
            src = _shape(call.args[0])
            ok = call.args[0] in inside and src is not None
            ok = ok and blk.equal(_shape(blk.var(j))[-1], src[-1])
        if ok:
            cand.members.append(j)
            inside.add(blk.var(j))
        else:
            tainted.add(blk.var(j))


def _prune(blk: _Block, cand: _Candidate) -> None:
    """Drop trailing reshapes, then keep the latest sink and what it depends on."""
    def sinks(members):
        used = set()
        for m in members:
            used.update(v for v in relax.analysis.free_vars(blk.bindings[m].value))
        return [m for m in members if blk.var(m) not in used]

    changed = True
    while changed:
        changed = False
        for s in sinks(cand.members):
            if ops.role_of(blk.call(s)) == "reshape":
                cand.members.remove(s)
                changed = True
    sink = max(sinks(cand.members))
    keep, stack = set(), [sink]
    member_of = {blk.var(m): m for m in cand.members}
    while stack:
        m = stack.pop()
        if m in keep:
            continue
        keep.add(m)
        stack += [member_of[v] for v in relax.analysis.free_vars(blk.bindings[m].value) if v in member_of]
    cand.members = sorted(keep)


def _dim(d):
    return int(d) if isinstance(d, tvm.tirx.IntImm) else d


def _dtype(var) -> str:
    return str(var.ty.dtype)


def _info(var) -> TensorInfo:
    return TensorInfo(tuple(_dim(d) for d in _shape(var) or ()), _dtype(var))


def _describe(blk: _Block, cand: _Candidate, function: str, index: int) -> FusionGroup:
    members = cand.members
    names = tuple(ops.op_name(blk.call(m)) for m in members)
    roles = {ops.role_of(blk.call(m)) for m in members}
    kind = GEMM_REDUCE if roles & {"reduction", "norm"} else GEMM_ELEMENTWISE
    inside = {blk.var(m) for m in members}
    inputs, seen = [], set()
    for m in members:
        for v in relax.analysis.free_vars(blk.bindings[m].value):
            if v not in inside and v not in seen:
                seen.add(v)
                inputs.append(_info(v))
    outputs = [
        _info(blk.var(m))
        for m in members
        if blk.var(m) in blk.escapes or any(u not in members for u in blk.users[blk.var(m)])
    ]
    gemm_idx = next(m for m in members if names[members.index(m)] == ops.GEMM)
    gemm = blk.call(gemm_idx)
    a_shape, out = _shape(gemm.args[0]), cand.out_shape
    batch = _prod(out[:-2]) if len(out) > 2 else 1
    return FusionGroup(
        kind=kind,
        ops=names,
        name=f"{kind}_{index}",
        function=function,
        gemm=tuple(_dim(d) for d in (batch, out[-2], out[-1], a_shape[-1])),
        dtype=_dtype(blk.var(gemm_idx)),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        bindings=tuple(blk.var(m) for m in members),
    )


def _b2b(blk: _Block, groups: list, function: str) -> list:
    """Back-to-back GEMM candidates: a GEMM + elementwise (or softmax) group whose result,
    at most ``B2B_MAX_INTERMEDIATE`` wide, is the left operand of another GEMM."""
    found = []
    anchors = {v: g for g in groups for v in g.bindings if ops.op_name(blk.call(blk.index[v])) == ops.GEMM}
    for g in groups:
        reductions = {op for op in g.ops if op in ops.ROW_REDUCTIONS or op in ops.ROW_NORMS}
        narrow = blk.analyzer.can_prove(tvm.tirx.IntImm("int64", B2B_MAX_INTERMEDIATE) >= g.gemm[2])
        if not reductions <= ops.B2B_REDUCTIONS or not narrow:
            continue
        frontier = [g.bindings[-1]]
        while frontier:
            v = frontier.pop()
            for u in blk.users[v]:
                call = blk.call(u)
                role = ops.role_of(call) if call is not None else None
                if role == "reshape" and blk.equal(_shape(blk.var(u))[-1], g.gemm[2]):
                    frontier.append(blk.var(u))
                elif role == "gemm" and call.args[0].same_as(v):
                    second = anchors.get(blk.var(u))
                    found.append(
                        FusionGroup(
                            kind=B2B_GEMM,
                            ops=g.ops + (second.ops if second else (ops.GEMM,)),
                            name=f"{B2B_GEMM}_{len(found)}",
                            function=function,
                            gemm=g.gemm,
                            dtype=g.dtype,
                            inputs=g.inputs,
                            outputs=second.outputs if second else (_info(blk.var(u)),),
                            fused=False,
                            note=(
                                f"a GEMM chain feeds a second GEMM through a {g.gemm[2]}-wide "
                                "intermediate; on sm_90 get_pipeline runs a pair of PyTorch linears "
                                "(N1 of 64 to 256) as one kernel with the intermediate on chip (the "
                                "'b2b' Hopper group); otherwise the two GEMMs keep separate kernels "
                                "(their groups are listed apart)"
                            ),
                        )
                    )
    return found


def find_groups(func: relax.Function, function: str = "main") -> list:
    """The fusion groups of one Relax function, in binding order (b2b candidates last)."""
    groups, b2b = [], []
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return groups
    for block in body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        blk = _Block(block)
        claimed, found = set(), []
        for i in range(len(blk.bindings)):
            cand = _anchor(blk, i, claimed)
            if cand is None:
                continue
            _grow(blk, cand, claimed)
            _prune(blk, cand)
            if not any(ops.role_of(blk.call(m)) in _CHAIN_ROLES for m in cand.members):
                continue  # a plain GEMM: nothing to fuse
            claimed.update(cand.members)
            group = _describe(blk, cand, function, len(groups) + len(found))
            if group.dtype not in SUPPORTED_DTYPES:
                group = replace(group, fused=False, note=(
                    f"its GEMM produces {group.dtype}; ComFuse fuses {', '.join(SUPPORTED_DTYPES)} GEMMs only, "
                    "so this chain is left to vanilla fusion (cast the GEMM's inputs to a supported dtype to fuse it)"))
            found.append(group)
        groups += found
        b2b += _b2b(blk, found, function)
    return groups + b2b
