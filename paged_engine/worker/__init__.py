"""Tensors and ranks: the model runner and its KV cache (everything ``engine/`` must not import)."""
