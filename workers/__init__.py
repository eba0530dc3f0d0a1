"""Importable worker modules: each exposes init_worker(ctx) and run_episode(task, ctx)."""
