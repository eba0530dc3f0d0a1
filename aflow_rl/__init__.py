"""aflow_rl: reinforcement learning for LLM orchestrators (DeepSpeed + joblib/loky workers, no Ray)."""
__version__ = "0.1.0"
