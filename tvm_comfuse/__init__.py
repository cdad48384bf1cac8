"""tvm-comfuse: fuse GEMMs with the memory-intensive subgraphs that consume them (ComFuse).

Public API::

    import tvm_comfuse
    tvm_comfuse.analyze(mod)                    # the fusion groups, as a list
    tvm_comfuse.FuseComputeMemory()             # the Relax pass (before LegalizeOps)
    tvm_comfuse.AnnotateFusedBlocks()           # kinds and block roles (after FuseTIR)
    tvm_comfuse.compile(mod, target)            # = tvm.compile with both ComFuse pipelines
"""

from .errors import ComFuseError
from .graph import B2B_GEMM, GEMM_ELEMENTWISE, GEMM_REDUCE, KINDS, FusionGroup, format_groups
from .pipeline import get_pipeline
from .runtime import compile_module as compile  # noqa: A001  (mirrors tvm.compile)
from .schedule.lowering import PASS_CONFIG, TIR_PIPELINE
from .target import parse_target
from .transform import AnnotateFusedBlocks, FuseComputeMemory, analyze

__version__ = "0.1.0"
