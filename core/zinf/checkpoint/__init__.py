"""Sharded checkpoints: every rank writes its own shard, rank 0 commits the save (commit.py); consolidation
turns them into one state dict.
``save_safetensors`` exports the model as Hugging Face safetensors files instead (rank 0 writes)."""

from zinf.checkpoint.export import save_safetensors
from zinf.checkpoint.sharded import consolidate, load_sharded, read_client_state, save_sharded
from zinf.errors import CheckpointError

__all__ = ["save_sharded", "load_sharded", "consolidate", "read_client_state", "save_safetensors", "CheckpointError"]
