"""The fusion group: what the pass found, in a form people and later stages can read."""

from __future__ import annotations

from dataclasses import dataclass, field

#: GEMM followed by an elementwise chain and at least one row reduction (LN, RMSNorm, softmax...).
GEMM_REDUCE = "gemm_reduce"
#: GEMM followed by elementwise ops only (bias, residual, activation, cast).
GEMM_ELEMENTWISE = "gemm_elementwise"
#: GEMM -> elementwise/reduction -> GEMM with a narrow intermediate (detected, not yet fused).
B2B_GEMM = "b2b_gemm"

KINDS = (GEMM_REDUCE, GEMM_ELEMENTWISE, B2B_GEMM)


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor crossing a group's boundary."""

    shape: tuple
    dtype: str

    def __str__(self) -> str:
        return "x".join(str(d) for d in self.shape) + f" {self.dtype}"


@dataclass(frozen=True)
class FusionGroup:
    """One compute-memory fusion group.

    ``ops`` lists the Relax operators in binding order, e.g. ``("relax.matmul", "relax.add",
    "relax.add", "relax.nn.layer_norm")``. ``gemm`` is ``(batch, M, N, K)`` of the anchor GEMM
    (``batch`` is 1 for a 2-D product). ``outputs`` has more than one entry when an
    intermediate is also used outside the group (e.g. the residual sum that a later layer
    reads): it is written out once instead of being recomputed. ``fused`` is False for a group
    that is detected but left to vanilla fusion; ``note`` says why.
    """

    kind: str
    ops: tuple
    name: str
    function: str
    gemm: tuple
    dtype: str
    inputs: tuple
    outputs: tuple
    fused: bool = True
    note: str = ""
    bindings: tuple = field(default=(), repr=False, compare=False)

    def row(self) -> dict:
        """The group as one table row of printable strings."""
        batch, m, n, k = self.gemm
        shape = f"{m}x{n}x{k}" if batch == 1 else f"{batch}x{m}x{n}x{k}"
        short = [op.rsplit(".", 1)[-1] for op in self.ops]
        return {
            "kind": self.kind if self.fused else f"{self.kind} (vanilla)",
            "name": self.name,
            "ops": " > ".join(short),
            "gemm MxNxK": shape,
            "dtype": self.dtype,
            "outputs": ", ".join(str(t) for t in self.outputs),
        }


def format_groups(groups) -> str:
    """Render groups as a plain-text table (kind, name, ops, shapes), one row each."""
    rows = [g.row() for g in groups]
    if not rows:
        return "(no compute-memory fusion groups)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(width[c]) for c in cols)
    out = [line, "  ".join("-" * width[c] for c in cols)]
    out += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    notes = [f"{g.name}: {g.note}" for g in groups if g.note]
    return "\n".join(out + notes)
