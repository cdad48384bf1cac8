"""AnnotateFusedBlocks: mark each fused PrimFunc's kind and each block's role (after FuseTIR).

FuseTIR drops Relax function attributes, so the kinds recorded by FuseComputeMemory in the
module attribute ``comfuse.groups`` are copied here onto the PrimFuncs (``comfuse.kind``),
and every block of such a PrimFunc gets a ``comfuse.role`` annotation that the schedule
rules dispatch on:

- ``prologue``: blocks that do not depend on the GEMM (the transposed weight of PyTorch's
  linear, casts of LayerNorm's gamma and beta),
- ``mainloop``: the GEMM itself (the first block with a reduction axis: a group starts at
  its GEMM by construction),
- ``epilogue``: spatial blocks after the GEMM and before the first row reduction (bias,
  residual, activation, cast),
- ``reduction``: row reductions after the GEMM (mean, variance, sum, max, ...) and the
  spatial blocks that finish a row statistic (``mean = sum / N``: they write one value a row),
- ``normalize``: the other spatial blocks after the first row reduction (the normalised
  output and anything applied to it).
"""

from __future__ import annotations

import tvm
import tvm.sym
from tvm import s_tir, tirx

from .fuse_compute_memory import GROUPS_ATTR, KIND_ATTR

ROLE_ATTR = "comfuse.role"
ROLES = ("prologue", "mainloop", "epilogue", "reduction", "normalize")


def _is_reduction(block: tirx.SBlock) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


def _numel(buffer):  # a write region's source buffer
    size = 1
    for dim in buffer.shape:
        size = size * dim
    return size


def block_roles(func: tirx.PrimFunc) -> list:
    """``[(block name, role)]`` for the root's child blocks of a fused group PrimFunc."""
    sch = s_tir.Schedule(func)
    roles, width, seen_reduction = [], None, False  # width: elements of the GEMM tile
    downstream = set()  # buffers computed from the GEMM result
    for rv in sch.get_child_blocks(sch.get_sblock("root")):
        block = sch.get(rv)
        size = _numel(block.writes[0].source) if block.writes else None
        reads_gemm = any(r.source in downstream for r in block.reads)
        if reads_gemm or width is None and _is_reduction(block):
            downstream.update(w.source for w in block.writes)
        if not reads_gemm and not (width is None and _is_reduction(block)):
            role = "prologue"  # weight transposes, parameter casts: independent of the GEMM
        elif _is_reduction(block):
            role = "reduction" if width is not None else "mainloop"
            seen_reduction |= width is not None
            width = size if width is None else width
        elif not seen_reduction:
            role = "epilogue"
        else:
            per_row = size is None or not tvm.sym.Analyzer().can_prove_equal(size, width)
            role = "reduction" if per_row else "normalize"
        roles.append((block.name_hint, role))
    return roles


def annotate_group(func: tirx.PrimFunc, kind: str) -> tirx.PrimFunc:
    """Return ``func`` with ``comfuse.kind`` set and every root child block's role annotated."""
    sch = s_tir.Schedule(func)
    for name, role in block_roles(func):
        sch.annotate(sch.get_sblock(name), ROLE_ATTR, role)
    return sch.mod["main"].with_attr(KIND_ATTR, kind)


@tvm.transform.module_pass(opt_level=0, name="AnnotateFusedBlocks")
class AnnotateFusedBlocks:  # pylint: disable=too-few-public-methods
    """Copy group kinds onto fused PrimFuncs and annotate their blocks' roles.

    Run after ``FuseTIR`` (``get_pipeline`` does). A no-op on modules FuseComputeMemory did
    not touch.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Annotate every PrimFunc named in the module's ``comfuse.groups`` attribute."""
        groups = mod.attrs[GROUPS_ATTR] if mod.attrs and GROUPS_ATTR in mod.attrs else {}
        mod = mod.clone()
        for gv, func in mod.functions_items():
            kind = groups.get(gv.name_hint) if isinstance(func, tirx.PrimFunc) else None
            if kind is not None and KIND_ATTR not in (func.attrs or {}):
                mod[gv] = annotate_group(func, str(kind))
        return mod
