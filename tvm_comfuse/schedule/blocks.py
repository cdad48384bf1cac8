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

    def walk(parent, done):
        for child in sch.get_child_blocks(parent):
            for i, region in enumerate(sch.get(child).writes):
                buf = region.source
                if buf.scope().startswith("shared") and not isinstance(buf.shape[0], tirx.IntImm) and buf.name not in done:
                    done.add(buf.name)
                    sch.transform_layout(
                        child, ("write", i), lambda *ix: (ix[0] // bm, ix[0] % bm, *ix[1:]), assume_injective_transform=True
                    )
            walk(child, done)

    walk(sch.get_sblock("root"), set())
