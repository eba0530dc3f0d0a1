"""Importable worker modules, one per environment (``env.name``): each names make_tasks, init_worker, run_episode."""
