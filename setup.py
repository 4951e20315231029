"""Packaging for the MoE training framework (model, parallel, kernels_cuda, moe_train)."""
import importlib.util
from pathlib import Path

from setuptools import find_packages, setup

# The CUDA build hook is loaded by path: importing the kernels_cuda package would import torch,
# which pip's build isolation may not have. It builds only with CUDA torch + nvcc, or when
# MOE_TRAIN_BUILD_CUDA=1 (then install with --no-build-isolation).
_spec = importlib.util.spec_from_file_location("kernels_cuda_build", Path(__file__).parent / "kernels_cuda" / "build_cuda.py")
_cuda_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cuda_build)

setup(
    name="moe-train",
    version="0.1.0",
    description="Megatron-style MoE training for DeepSeek-V3-like models (EP + PP + DP)",
    python_requires=">=3.10",
    packages=find_packages(include=["model*", "parallel*", "kernels_cuda*", "moe_train*"]),
    package_data={"moe_train": ["configs/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "pyyaml",
        "safetensors",
        "numpy",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest>=7", "transformers>=4.48", "matplotlib", "wandb"],
        "wandb": ["wandb"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
        "gpu": ["ninja"],
        "nvshmem": ["nvidia-nvshmem-cu13"],
    },
    entry_points={"console_scripts": ["moe-train=moe_train.train:main"]},
    ext_modules=_cuda_build.cuda_ext_modules(),
    cmdclass=_cuda_build.cuda_cmdclass(),
)
