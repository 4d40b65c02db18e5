"""Sharded checkpoints: every rank writes its own shard; consolidation turns them into one state dict."""

from zinf.checkpoint.sharded import consolidate, load_sharded, read_client_state, save_sharded

__all__ = ["save_sharded", "load_sharded", "consolidate", "read_client_state"]
