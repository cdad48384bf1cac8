"""Reading a fused PrimFunc's annotated blocks, and the inlining every ComFuse rule starts with."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx

from ..transform.annotate_blocks import ROLE_ATTR


@dataclass
class GroupBlocks:
    """The root-level blocks of a fused group PrimFunc, by role, in program order."""

    mainloop: object = None
    prologue: list = field(default_factory=list)
    after: list = field(default_factory=list)  # epilogue, reduction, normalize, in order
    roles: dict = field(default_factory=dict)  # block name -> role


def read_blocks(sch: s_tir.Schedule) -> GroupBlocks | None:
    """Group the root's child blocks by their ``comfuse.role``; None if unannotated."""
    out = GroupBlocks()
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        block = sch.get(rv)
        role = block.annotations.get(ROLE_ATTR)
        if role is None:
            return None
        role = str(role)
        out.roles[block.name_hint] = role
        if role == "mainloop":
            if out.mainloop is not None:
                return None
            out.mainloop = rv
        elif role == "prologue":
            out.prologue.append(rv)
        else:
            out.after.append(rv)
    return out if out.mainloop is not None else None


def output_buffers(func: tirx.PrimFunc) -> set:
    """The buffers a PrimFunc writes for its caller (its parameters)."""
    return set(func.params)  # tirx buffers are the parameters themselves


def writes_output(sch: s_tir.Schedule, rv, outputs: set) -> bool:
    """True if the block writes one of the function's output buffers."""
    return any(w.source in outputs for w in sch.get(rv).writes)


def is_reduction(sch: s_tir.Schedule, rv) -> bool:
    """True if the block has a reduction iterator."""
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(rv).iter_vars)


def copied_buffer(sch: s_tir.Schedule, rv):
    """The buffer a block only copies or casts (``astype``, identity), else None."""
    body = sch.get(rv).body
    value = body.value if isinstance(body, tirx.BufferStore) else None
    if isinstance(value, tirx.Cast):
        value = value.value
    return value.source if isinstance(value, tvm.ir.TensorLoad) else None


def inline_all(sch: s_tir.Schedule, blocks: list, keep=()) -> list:
    """compute_inline every spatial block it can (not those in ``keep``); return the rest."""
    keep_names = {sch.get(rv).name_hint for rv in keep}
    rest = []
    for rv in blocks:
        if sch.get(rv).name_hint in keep_names or is_reduction(sch, rv):
            rest.append(rv)
            continue
        try:
            sch.compute_inline(rv)
        except Exception:  # pylint: disable=broad-except  # output blocks cannot be inlined
            rest.append(rv)
    return rest


def tile_symbolic_rows(sch: s_tir.Schedule, bm: int) -> None:
    """Give every on-chip buffer whose row count is symbolic a ``[rows // bm, bm, ...]`` layout.

    Why: with a symbolic M, TVM compacts a block-local buffer to the rows a thread block
    touches intersected with the buffer's own extent, ``min(M, bm)``: a symbolic size that
    CUDA codegen cannot allocate. Split by the row tile, the block's slice is exactly
    ``[1, bm, ...]``, a constant. Only the layout changes (rows past M are never read), so the
    transform is declared injective instead of padded.
    """

    for block, index, buf in written_buffers(sch):
        if buf.scope().startswith("shared") and not isinstance(buf.shape[0], tirx.IntImm):
            sch.transform_layout(
                block, ("write", index), lambda *ix: (ix[0] // bm, ix[0] % bm, *ix[1:]), assume_injective_transform=True
            )


def written_buffers(sch: s_tir.Schedule, parent=None, done=None):
    """``(block, write index, buffer)`` for each buffer, at the first block (depth first, in
    program order) that writes it: where a layout transform of that buffer is applied."""
    done = set() if done is None else done
    for child in sch.get_child_blocks(parent if parent is not None else sch.get_sblock("root")):
        for i, region in enumerate(sch.get(child).writes):
            if region.source.name not in done:
                done.add(region.source.name)
                yield child, i, region.source
        yield from written_buffers(sch, child, done)


def uses_var(expr, var) -> bool:
    """True if the index expression ``expr`` reads ``var``."""
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def flatten_batch_rows(sch: s_tir.Schedule, g: GroupBlocks) -> tuple | None:
    """Iterate ``[B, S, ...]`` blocks as ``[B * S, ...]`` rows when the GEMM's weight is shared by
    the batch (``x[B, S, K] @ w[K, N]``, how models apply a linear layer to 3-D activations).

    Why: the tensor-core mainloop tiles a 2-D ``rows x N`` GEMM; with the batch as a separate
    iterator it would not apply. The blocks iterate ``b, s -> r`` (``b = r // S``, ``s = r %
    S``); buffers are untouched (see :func:`flatten_row_buffers`). Returns ``(B, S)`` if the
    group was flattened, else None.
    """
    mm = sch.get(g.mainloop)
    ivs = mm.iter_vars
    if len(ivs) != 4 or any(iv.iter_type != tirx.IterVar.DataPar for iv in ivs[:3]):
        return None
    out = {w.source for w in mm.writes}
    operands = [r for r in mm.reads if r.source not in out]
    if len(operands) != 2 or any(uses_var(r.min, ivs[0].var) for r in operands[1].region):
        return None  # a batched weight (attention's q @ k.T): a real batch, not rows
    lead = _static([ivs[0].dom.extent, ivs[1].dom.extent])
    if None in lead:
        return None
    _flatten_iterations(sch, [g.mainloop, *g.prologue, *g.after], tuple(lead))
    return tuple(lead)


def _flatten_iterations(sch: s_tir.Schedule, blocks: list, rows: tuple) -> None:
    for rv in blocks:
        ivs = sch.get(rv).iter_vars
        if len(ivs) >= 2 and all(iv.iter_type == tirx.IterVar.DataPar for iv in ivs[:2]) and _static(
            [iv.dom.extent for iv in ivs[:2]]
        ) == list(rows):
            sch.transform_block_layout(rv, _fuse_rows(rows[1], len(ivs)))


def flatten_row_buffers(sch: s_tir.Schedule, rows: tuple, blocks: list = ()) -> None:
    """Give every on-chip or intermediate ``[B, S, ...]`` buffer the ``[B * S, ...]`` layout, so the
    flattened blocks index it by their row ``r`` (cross-thread reductions need their outputs
    indexed by plain block variables), after flattening the iteration of ``blocks`` made since
    :func:`flatten_batch_rows` (a cache's copy block iterates its buffer's shape). The
    parameters, and so the function's signature, keep their shapes."""
    _flatten_iterations(sch, blocks, rows)
    params = output_buffers(sch.mod["main"])
    for block, index, buf in written_buffers(sch):
        if buf not in params and _static(buf.shape[:2]) == list(rows):
            sch.transform_layout(block, ("write", index), _fuse_rows(rows[1], len(buf.shape)))


def _static(dims) -> list:
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in dims]


def _fuse_rows(seq: int, ndim: int) -> tirx.IndexMap:
    return tirx.IndexMap.from_func(lambda b, s, *rest: (b * seq + s, *rest), ndim=ndim)
