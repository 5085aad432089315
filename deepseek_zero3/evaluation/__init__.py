"""Evaluation beside eval.py: downstream tasks through lm-evaluation-harness (harness_tasks.py)."""
