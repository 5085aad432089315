"""The training recipe: the LR schedules (schedule.py) and DeepSeek LLM's scaling laws for hyperparameters and the
compute-optimal model and data (scaling.py)."""
