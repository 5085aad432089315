"""The model: config presets, tokenizers and model directories (models.py), MoE load balancing (moe.py), the loss
over the output layer in chunks (lmloss.py)."""
