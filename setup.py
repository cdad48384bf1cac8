"""tvm-comfuse: compute-memory fusion (GEMM + reductions in the epilogue) for Apache TVM."""

from setuptools import find_packages, setup

setup(
    name="tvm-comfuse",
    version="0.1.0",
    description="ComFuse for TVM: fuse GEMMs with the LayerNorm/RMSNorm/softmax chains after them",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tvm_comfuse", "tvm_comfuse.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Pinned together: apache-tvm-ffi 0.1.15.x segfaults in TVM 0.27's error paths
        # (e.g. a failing tensorize), so the default resolution of apache-tvm is unusable.
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.14.post0",
        "numpy",
        "ml_dtypes",
        "xgboost",
        "psutil",
        "cloudpickle",
        "tqdm",
    ],
    extras_require={
        "models": ["torch>=2.4", "transformers>=4.45"],
        # nvidia-cuda-nvdisasm: the SASS checks of the Hopper kernels (tests/test_codegen.py)
        "test": ["pytest>=7", "torch>=2.4", "transformers>=4.45", "nbformat", "nbclient", "ipykernel", "matplotlib",
                 "nvidia-cuda-nvdisasm"],
    },
    entry_points={"console_scripts": ["comfuse=tvm_comfuse.cli.main:main"]},
)
