"""A run's directory: checkpoints and resume (checkpoint.py), metrics.jsonl (metrics.py), the lock, stop signals,
watchdog and skipped steps (resilience.py), a checkpoint read as a model (run_model.py), a finished run's export
(finish.py) and its model card (card.py)."""
