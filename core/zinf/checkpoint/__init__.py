"""The model's state outside training. Sharded checkpoints: every rank writes its own part, rank 0 commits the
save (commit.py), any world size and placement loads it (model_state.py, part_file.py); ``consolidate`` and
``iter_state`` rebuild the full state from the files. ``save_safetensors`` exports the model as Hugging Face
safetensors files instead (rank 0 writes), ``export_checkpoint`` (``zinf consolidate``) a checkpoint as model
files; ``load_pretrained`` streams such files into a partitioned model. Saving, loading and exporting read a
model in training through ``ModelSource`` (source.py), which the engine satisfies."""

from zinf.checkpoint.convert import export_checkpoint
from zinf.checkpoint.export import save_safetensors
from zinf.checkpoint.sharded import (consolidate, iter_state, load_sharded, open_checkpoint, read_client_state,
                                     save_sharded, state_specs)
from zinf.checkpoint.source import ModelSource
from zinf.errors import CheckpointError

__all__ = ["save_sharded", "load_sharded", "consolidate", "iter_state", "state_specs", "open_checkpoint",
           "read_client_state", "save_safetensors", "export_checkpoint", "ModelSource", "CheckpointError"]
