"""Packaging for the MoE training framework (model, parallel, kernels_cuda, moe_train)."""
from setuptools import find_packages, setup

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
        "test": ["pytest>=7", "transformers>=4.48", "matplotlib"],
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],
        "gpu": ["ninja"],
    },
    entry_points={"console_scripts": ["moe-train=moe_train.train:main"]},
)
