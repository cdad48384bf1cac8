"""Row statistics shared by the CTAs of a thread-block cluster, through distributed shared memory.

When a row is split over the ``ranks`` CTAs of a cluster (each owns a column slice of the
GEMM tile), every row reduction is computed in two steps: each CTA reduces its own slice
(``rfactor``), then the partial results are exchanged and every CTA combines all of them for
its rows. The exchange is one tensor intrinsic, ``allgather``: a CTA pushes its ``count``
partials into the same shared-memory slot of every CTA of the cluster (``mapa`` +
``st.shared::cluster``) between two cluster barriers: the first waits until every CTA is done
with what came before (its shared memory may be reused storage), the second (release/acquire)
makes the pushes visible. After
it each CTA reads the ``ranks x count`` partials from its own shared memory, so nothing but the
pushes crosses CTAs, and no row statistic goes to HBM.

In TensorIR the copy is ``C[rank, i] = A[rank, i]`` under the loop over the cluster's ranks
(bound to ``clusterCtaIdx.x``), so the sequential meaning of the program is unchanged: after
the loop every slot of ``C`` is written, which is what the pushes achieve on the GPU.
"""

from __future__ import annotations

import re

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

#: PTX store width per dtype (``st.shared::cluster`` of one element).
_PTX = {"float32": ("f32", "f", "float"), "float16": ("b16", "h", "half")}


def supported(dtype: str) -> bool:
    """Whether partial statistics of ``dtype`` can be exchanged."""
    return dtype in _PTX


def _source(name: str, dtype: str, count: int, ranks: int) -> str:
    ptx, reg, ctype = _PTX[dtype]
    value = "v" if dtype == "float32" else "__half_as_ushort(v)"
    return f"""
__forceinline__ __device__ void {name}({ctype}* dst, {ctype}* src) {{
  // every CTA of the cluster is past its previous reads of shared memory (so a push cannot
  // land in a buffer a peer still reads, whatever storage reuse did), and the partials are done
  asm volatile("barrier.cluster.arrive.aligned;\\n\\tbarrier.cluster.wait.aligned;" ::: "memory");
  const unsigned int base = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < {count * ranks}; i += blockDim.x * blockDim.y) {{
    const int rank = i / {count}, j = i % {count};
    const {ctype} v = src[j];
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(base + j * {_bytes(dtype)}), "r"(rank));
    asm volatile("st.shared::cluster.{ptx} [%0], %1;" :: "r"(remote), "{reg}"({value}) : "memory");
  }}
  asm volatile("barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}}
"""


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def allgather(dtype: str, count: int, ranks: int) -> str:
    """The name of the registered ``allgather`` intrinsic for ``count`` partials of ``dtype``
    per CTA over ``ranks`` CTAs (registered on first use)."""
    name = f"comfuse_cluster_allgather_{dtype}_{count}_x{ranks}"
    if TensorIntrin.get(name, allow_missing=True) is None:
        register(name, dtype, count, _source(name, dtype, count, ranks))
    return name


#: What :func:`allgather` names: ``(dtype, count, ranks)`` back from a name in any text.
_NAME = re.compile(r"comfuse_cluster_allgather_(\w+?)_(\d+)_x(\d+)")


def register_named(text: str) -> None:
    """Register every ``allgather`` intrinsic ``text`` names (a tuning-record file's traces)."""
    for dtype, count, ranks in sorted(set(_NAME.findall(text))):
        allgather(dtype, int(count), int(ranks))


def register(name: str, dtype: str, count: int, source: str) -> None:
    """Register ``C[0, :count] = A[0, :count]`` (shared to shared) implemented by a call of the
    CUDA function ``name(C, A)`` defined in ``source``."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1, count), dtype, scope="shared", offset_factor=1)
        C = T.match_buffer(c, (1, count), dtype, scope="shared", offset_factor=1)
        with T.sblock("root"):
            T.reads(A[0, 0:count])
            T.writes(C[0, 0:count])
            for i in range(count):
                with T.sblock("copy"):
                    vi = T.axis.remap("S", [i])
                    C[0, vi] = A[0, vi]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (1, count), dtype, scope="shared", offset_factor=1)
        C = T.match_buffer(c, (1, count), dtype, scope="shared", offset_factor=1)
        with T.sblock("root"):
            T.reads(A[0, 0:count])
            T.writes(C[0, 0:count])
            T.evaluate(T.cuda.func_call(name, C.access_ptr("w"), A.access_ptr("r"), source_code=source))

    TensorIntrin.register(name, desc, impl)
