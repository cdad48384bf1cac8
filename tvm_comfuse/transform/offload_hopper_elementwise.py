"""OffloadHopperElementwise: GEMM + elementwise groups to the wgmma kernel on sm_90 (opt-in).

Runs right after FuseComputeMemory (and OffloadHopperPostNorm), on its outlined
``gemm_elementwise`` functions. One whose body is

    matmul(x, permute_dims(w)) -> casts, adds (a bias [N], a tile [..., N]) and activations
        (gelu, gelu_tanh, relu, silu) -> one output

as an imported BERT's FFN1 (``gelu(x @ w.T + b)``) and Q, K and V projections (``x @ w.T + b``)
are, is read into an :class:`~tvm_comfuse.schedule.wgmma_elementwise.Elementwise` description;
if the kernel takes its shape (M and N multiples of a tile, static shapes), the kernel is built
for it and the call becomes ``R.call_dps_packed`` of it, as OffloadHopperPostNorm does. Anything
else (another op, a second output, an unused binding, shapes the kernel cannot take) is left to
the ``gemm_elementwise`` rule.

Off by default (``get_pipeline(target, hopper_elementwise=True)`` turns it on): written and
checked on CPU in session 14 (the generated code compiles for sm_90a without spills or
accumulator hazards; the NumPy model of the kernel in its place gives the graph's values), not
yet run on a GPU. Why it should pay: BERT-base's FFN1 + GELU took 102 us a layer under the rule
on the H200 (session 10), where the wgmma mainloop ran the same GEMM shape as a plain GEMM at
0.77x of cuBLAS (~35 us).
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from ..target import parse_target
from .fuse_compute_memory import KIND_ATTR
from .offload_hopper import GroupBody, _sinfo, build_kernel, is_hopper, replace_calls

LOG = logging.getLogger("tvm_comfuse")


def match_elementwise(func: relax.Function):
    """``(spec, roles, (M, N, K), out_shape)`` for a GEMM + elementwise function, or None.

    ``roles`` are the indices of the function's parameters for the kernel's ``x, w, operand 0,
    ...``; ``out_shape`` is ``[*rows, N]``."""
    from ..schedule.chain import ACTIVATIONS  # pylint: disable=import-outside-toplevel
    from ..schedule.wgmma_elementwise import Elementwise  # pylint: disable=import-outside-toplevel

    body = GroupBody(func)
    if body.var2val is None or len(body.outs) != 1 or not isinstance(body.outs[0], relax.Var) or body.outs[0] not in body.var2val:
        return None
    out_shape, out_dtype = _sinfo(body.outs[0])
    found = body.chain_to_gemm(body.outs[0], ACTIVATIONS) if out_shape is not None else None
    if found is None or not body.all_used():
        return None
    linear = body.linear(found, out_shape)
    if linear is None:
        return None
    steps, operands, roles, mnk = linear
    return Elementwise(_sinfo(found[1])[1], steps, operands, out_dtype), roles, mnk, out_shape


def taken_groups(mod: tvm.IRModule):
    """``(global var, function, match_elementwise's result)`` of each outlined
    ``gemm_elementwise`` group of ``mod`` the wgmma kernel takes (the others are logged with
    the reason)."""
    from ..schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or str((func.attrs or {}).get(KIND_ATTR, "")) != "gemm_elementwise":
            continue
        found = match_elementwise(func)
        if found is None:
            continue
        why = we.problems(*found[2], found[0])
        if why:
            LOG.info("ComFuse: %s stays with the gemm_elementwise rule, the wgmma kernel cannot take %s", gv.name_hint, "; ".join(why))
            continue
        yield gv, func, found


@tvm.transform.module_pass(opt_level=0, name="OffloadHopperElementwise")
class OffloadHopperElementwise:  # pylint: disable=too-few-public-methods
    """Replace the GEMM + elementwise groups the wgmma kernel takes by calls of it (see the
    module docstring); a no-op unless ``target`` is an sm_90 CUDA target or ``build`` is given.

    ``build(prim_func, symbol, spec, (m, n, k))`` makes each kernel available under ``symbol``,
    as :class:`~tvm_comfuse.transform.OffloadHopperPostNorm`'s does (the CPU tests register a
    NumPy model). Groups that compute the same kernel (a model's layers) share one build.
    """

    def __init__(self, target, build=None):
        self.target = parse_target(target)
        self.build = build

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Build each eligible group's kernel, rewrite its calls, drop the outlined function."""
        from ..schedule import wgmma_elementwise as we  # pylint: disable=import-outside-toplevel

        if self.build is None and not is_hopper(self.target):
            return mod
        build = self.build or (lambda func, symbol, _spec, _mnk: build_kernel(func, symbol, self.target))
        offloads, built, symbols = {}, [], {}
        for gv, _func, (spec, roles, mnk, out_shape) in taken_groups(mod):
            key = (spec, mnk, tuple(out_shape))
            if key not in symbols:
                symbols[key] = f"comfuse_wgmma_ew_{len(symbols)}_{gv.name_hint}"[:120]
                module = build(we.wgmma_elementwise(*mnk, spec, lead=out_shape[:-1]), symbols[key], spec, mnk)
                if module is not None:
                    built.append(module)
            offloads[gv.name_hint] = (symbols[key], roles, out_shape, spec.out_dtype, ("out",))
        if not offloads:
            return mod
        LOG.info("ComFuse: %d GEMM + elementwise group(s) run as %d wgmma kernel(s)", len(offloads), len(symbols))
        return replace_calls(mod, offloads, built)
