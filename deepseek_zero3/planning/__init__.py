"""The planner: the entry points (plan.py), model arithmetic (model_math.py), what a strategy costs (costs.py),
what this machine measures (measure.py)."""
