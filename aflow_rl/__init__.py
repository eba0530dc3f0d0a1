"""aflow_rl: reinforcement learning for LLM orchestrators (DeepSpeed + a pool of worker processes, no Ray)."""
__version__ = "0.1.0"
