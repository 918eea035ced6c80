"""megatron_branch: exact branch replay for RL post-training on Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron_branch",
    version="0.1.0",
    description=(
        "Exact branch replay (prefix-tree deduplication of RL rollouts) for Megatron-Core: "
        "each unique token position computed once, gradients equal to per-rollout training."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_branch", "megatron_branch.*"]),
    install_requires=[
        # Install torch first (README): a bare requirement here would pull a CUDA build.
        "torch>=2.4",
        "megatron-core>=0.16,<0.20",
        "numpy",
        "packaging",
        "psutil",  # megatron-core's dist-checkpointing (checkpoint/resume, HF conversion)
    ],
    extras_require={
        "dev": ["pytest>=7", "psutil", "safetensors", "matplotlib", "transformers", "nemo-run==0.11.1", "leptonai<0.47",
                "nvidia-modelopt==0.47.*", "requests", "huggingface_hub", "prefix_grouper"],
        # GPU machines only: never let pip build Transformer Engine on a CPU machine.
        "te": ["transformer-engine[pytorch]"],
        "modelopt": ["nvidia-modelopt==0.47.*", "requests", "huggingface_hub"],
        "hf": ["transformers", "safetensors"],
        # the bench's comparison with the real prefix_grouper package (what verl's use_prefix_grouper runs)
        "peer": ["prefix_grouper", "transformers", "safetensors"],
        "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
        # Gated DeltaNet (megatron-core >= 0.19): Megatron's GatedDeltaNet refuses to build without
        # flash-linear-attention; on CPU only its import is needed (megatron_branch.cpu shims its l2norm,
        # and deterministic_mode selects Megatron's torch kernels).
        "hybrid": ["flash-linear-attention==0.6.0", "fla-core==0.6.0", "einops"],
        # the verl 0.9.1 engine adapter (megatron_branch.integrations.verl); verl pins transformers < 5.11
        # and tensordict <= 0.10, so it gets its own venv in .ci/run. Its plugin entry point below makes
        # verl import the adapter, which registers the engine (verl selects it with VERL_ENGINE_VENDOR=branch).
        # mbridge (and einops, which it imports without declaring) is verl's vanilla bridge
        # (megatron.vanilla_mbridge=True), the path the CPU tests build through: Megatron-Bridge needs TE.
        "verl": ["verl==0.9.1", "mbridge==0.15.1", "einops", "pytest>=7"],
        # What Megatron-LM's megatron/training (pretrain) and Megatron-RL (train_rl.py) import
        # at core_v0.16.1, core_v0.19.0 and main (openai, omegaconf from 0.19); Megatron-LM itself is a git
        # checkout (patches/megatron-lm-*).
        "megatron-lm": ["triton", "tensorboard", "wandb", "pydantic", "pyyaml", "regex", "transformers", "fastapi",
                        "uvicorn", "httpx", "openai[aiohttp]", "omegaconf"],
    },
    entry_points={
        "console_scripts": ["megatron-branch=megatron_branch.cli:main"],
        "verl.plugins": ["megatron_branch=megatron_branch.integrations.verl"],
    },
)
