"""How many thread-block clusters of one-CTA-per-SM kernels fit the H200 at once? (issues 3 and 8)

The row-tiles experiment (session 10) found the fused post-norm with clusters of four 128-row
CTAs about one mainloop slower than its plain GEMM, and sessions 3 and 8 saw the same cost with
four-CTA clusters; two-CTA clusters cost nothing measurable. The explanation offered: a cluster
must fit one GPC, the GPCs' SM counts are not all multiples of four, so fewer than the 32
four-CTA clusters a 128-CTA wave needs are resident at once, and a second wave runs.

This asks the driver (``cudaOccupancyMaxActiveClusters``) for a kernel shaped like the post-norm
one (384 threads, ~208 KiB of dynamic shared memory: one CTA per SM), for cluster sizes 1-8.
Prediction: 132 single CTAs, 66 pairs, fewer than 32 clusters of four.

Run on the GPU (nvcc is there): ``bash .ci/gpu-run notebooks/results/experiments/cluster_occupancy.py``
(writes ``$OUT/cluster-occupancy.json``).
"""

import json
import os
import subprocess
import tempfile

SOURCE = r"""
#include <cstdio>
#include <cuda_runtime.h>
__global__ void probe(float* out) { extern __shared__ float s[]; s[threadIdx.x] = 1.f; if (out) out[0] = s[0]; }
int main() {
  int smem = 208 * 1024, threads = 384;
  cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  printf("{");
  for (int size = 1; size <= 16; ++size) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = size; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(size * 64); cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr; cfg.numAttrs = 1;
    int clusters = -1;
    cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, (void*)probe, &cfg);
    printf("%s\"%d\": %d", size > 1 ? ", " : "", size, err == cudaSuccess ? clusters : -1);
  }
  printf("}\n");
  return 0;
}
"""


def main():
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.cu"), os.path.join(tmp, "probe")
        with open(src, "w", encoding="utf-8") as fh:
            fh.write(SOURCE)
        subprocess.run(["nvcc", "-arch=sm_90a", "-o", exe, src], check=True)
        clusters = json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    result = {"gpu": gpu, "kernel": "384 threads, 208 KiB dynamic shared memory (one CTA per SM)",
              "max_active_clusters": clusters, "ctas_resident": {s: int(s) * n for s, n in clusters.items() if n > 0}}
    print(json.dumps(result))
    with open(os.path.join(os.environ.get("OUT", "."), "cluster-occupancy.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
