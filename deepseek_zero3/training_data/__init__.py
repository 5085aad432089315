"""The token files read for training (train.py, eval.py): their format (meta.json, dtype, checked reader), the sample
order and the batch plan."""
