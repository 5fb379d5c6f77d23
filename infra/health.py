"""Health checks the recipes run around training."""

from __future__ import annotations

import zlib

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object


class DesyncError(RuntimeError):
    """Data-parallel replicas that should be identical are not."""


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """CRC32 over every parameter's bytes, in name order: equal iff the weights are bit-identical (in practice)."""
    crc = 0
    for name, param in sorted(model.named_parameters()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(param.detach().float().cpu().contiguous().numpy().tobytes(), crc)
    return f"{crc:08x}"


def check_replicas_in_sync(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Gather every rank's parameter fingerprint and raise if data-parallel replicas differ.

    Only meaningful where each rank holds the whole model (DDP, single process); sharded
    strategies (ZeRO-3, FSDP) hold different shards by design and are not checked.
    """
    if accelerator.num_processes == 1 or accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return []
    fingerprints = gather_object([parameter_fingerprint(accelerator.unwrap_model(model))])
    if len(set(fingerprints)) != 1:
        raise DesyncError(f"data-parallel replicas diverged: parameter fingerprints by rank {fingerprints}")
    accelerator.print(f"parameters identical on all {len(fingerprints)} ranks: fingerprints {fingerprints}")
    return fingerprints
