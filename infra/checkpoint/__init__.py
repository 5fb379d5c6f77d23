"""Checkpoints: one concern per module.

- `manager`: save, commit, resume the newest that verifies, prune;
- `staging`: background saves (`async_save`): the state copied to CPU memory, written from a thread;
- `integrity`: checksums and sizes in the manifest, sealed by every rank's share, checked before a load;
- `retention`: which checkpoints are kept (and how many, for the disk preflight);
- `clock`: when a save is due (steps, minutes, Young/Daly);
- `trainable`: a model with frozen parameters (LoRA) saves and loads the others only;
- `reshard`: a ZeRO checkpoint from another world size or stage, converted once to DeepSpeed's universal format;
- `engines`: a DDP checkpoint resumed under ZeRO and the reverse, through the same per-parameter format;
- `remote`: checkpoints uploaded to object storage, and downloaded on resume;
- `weights`: a checkpoint's model weights, whole, whatever engine wrote them (for `python -m infra.export`).
"""

from infra.checkpoint.clock import SaveClock, SaveClockConfig
from infra.checkpoint.integrity import CheckpointError, Checksums, problem, read_manifest, seal, seal_shared, share
from infra.checkpoint.manager import CONFIG, CORRUPT, CheckpointConfig, CheckpointManager, manifest_of
from infra.checkpoint.retention import RetentionConfig, RetentionPolicy

__all__ = [
    "CONFIG",
    "CORRUPT",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "Checksums",
    "RetentionConfig",
    "RetentionPolicy",
    "SaveClock",
    "SaveClockConfig",
    "manifest_of",
    "problem",
    "read_manifest",
    "seal",
    "seal_shared",
    "share",
]
