"""A checkpoint's model weights, whole, in one process, whatever engine wrote them (for `python -m infra.export`).

- DDP or one process: save_state's `model.safetensors` (every rank held the whole model);
- DeepSpeed ZeRO: the fp32 master weights gathered from every rank's partition by DeepSpeed's `zero_to_fp32`;
- FSDP: the sharded state dict merged by accelerate's `merge_fsdp_weights` (torch distributed checkpoint).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from infra.checkpoint.integrity import read_manifest
from infra.checkpoint.reshard import ZERO_FOLDER

FSDP_FOLDER = "pytorch_model_fsdp_0"  # accelerate's folder of the first model's sharded state dict


def full_state_dict(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's weights by name; `scratch` is a folder on a disk with room for one copy of them (FSDP's merge)."""
    engine = read_manifest(checkpoint).get("distributed_type")
    if engine == DistributedType.DEEPSPEED.value:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=ZERO_FOLDER))
    if engine == DistributedType.FSDP.value and (checkpoint / FSDP_FOLDER).is_dir():
        from accelerate.utils import merge_fsdp_weights

        with tempfile.TemporaryDirectory(dir=scratch, prefix=".merge-") as tmp:
            merge_fsdp_weights(str(checkpoint / FSDP_FOLDER), tmp, safe_serialization=True)
            return {k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in load_file(f).items()}
    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint} holds no model weights this version reads (engine {engine})")
    return {k: v for f in files for k, v in load_file(f).items()}
