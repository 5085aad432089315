"""Tokens out: the token files' format (meta.json, dtype, checked reader), the sample order and the batch plan."""
