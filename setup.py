"""ds_maximus: swappable vocab rows and MoE experts for DeepSpeed.

``pip install -e .`` installs the package and its console scripts. Ops JIT-compile on first use
into ``build/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``).
"""
from setuptools import find_packages, setup

setup(
    name="ds_maximus",
    version="0.1.0",
    description="DeepSpeed extension: vocabulary rows and MoE experts as swappable GPU/CPU/NVMe partitions",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_maximus", "ds_maximus.*"]) + ["ds_maximus.op_builder"],
    # our builders live in the top-level op_builder/ folder but install under our own namespace, so
    # they never claim the generic top-level name "op_builder" that DeepSpeed probes
    package_dir={"ds_maximus.op_builder": "op_builder"},
    install_requires=[
        "torch>=2.4",
        "deepspeed==0.19.8",
        "transformers>=4.45",
        "safetensors",
        "tokenizers",
        "accelerate",  # HF Trainer's DeepSpeed path goes through accelerate
        "pydantic>=2",
        "tqdm",
        "matplotlib",  # benchmarks.plot draws the README charts
        "ninja",
        "pytest",
        "peft",  # the conformance suite and PEFT models (LoRA adapters beside maximus rows)
    ],
    entry_points={
        "console_scripts": [
            "maximus-tokenizer=ds_maximus.tokenmap.cli:main",
            "maximus-export=ds_maximus.integrations.export_cli:main",
            "maximus-env-report=ds_maximus.env_report:main",
        ]
    },
)
