"""Frozen models beside the trained one (infra.job.Companion), placed as the engine needs them.

    DDP, one process   on the device, in eval mode, its forward under the run's autocast: a frozen module needs no
                       wrapper (no gradient to reduce), and every rank holds it whole
    DeepSpeed          an inference engine from the run's DeepSpeed config without its optimizer: under ZeRO-3 sharded
                       like the policy (gathered layer by layer in the forward), under ZeRO-1/2 whole (stage 0), as
                       TRL prepares its reference model
    FSDP2              `fully_shard` by the run's own plugin (the same units, mesh and mixed-precision policy)

None of them is registered with the Accelerator: `save_state` writes the trained model's state and nothing else, and a
resume builds each companion again from its source (the manifest records them: `companions`).
"""

from __future__ import annotations

import copy
import functools

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from infra.distributed import ready_for_fsdp
from infra.job import Companion
from infra.memory import parameter_count


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """No gradient, eval mode (no dropout): a companion computes the same thing at every step."""
    model.requires_grad_(False)
    model.eval()  # DeepSpeed's engine returns None from eval()
    return model


def prepare_companions(accelerator: Accelerator, companions: dict[str, Companion]) -> list[str]:
    """Each companion's `model` replaced by the one placed for the engine, and a line saying how. After the trained model
    is prepared (DeepSpeed's config then holds its resolved values); in the same order on every rank (ZeRO-3 and FSDP2
    shard collectively)."""
    lines = []
    for name, companion in companions.items():
        total = parameter_count(companion.model)
        companion.model = prepare_one(accelerator, frozen(companion.model))
        here = held(companion.model)
        how = f"sharded: {here:,} on this rank" if here < total else "whole on each rank"
        lines.append(f"companion {name}: {total:,} parameters, {how}; not checkpointed (loaded from {companion.source} at each launch)")
    return lines


def held(model: torch.nn.Module) -> int:
    """The parameters this rank holds of a model: its ZeRO-3 partitions or FSDP2 shards, else all of them."""
    count = 0
    for p in model.parameters():
        local = getattr(p, "ds_tensor", None)  # ZeRO-3: the parameter itself is an empty placeholder
        count += (local if local is not None else getattr(p, "_local_tensor", p)).numel()
    return count


def prepare_one(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return deepspeed_inference(accelerator, model)
    if kind == DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        ready_for_fsdp(accelerator, model)
        return frozen(fsdp2_prepare_model(accelerator, model))
    model = model.to(accelerator.device)
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):  # what accelerate does to the trained model's forward in prepare()
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    return model


def deepspeed_inference(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A DeepSpeed engine without optimizer for a frozen model: ZeRO-3 shards it, a lower stage keeps it whole."""
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for block in ("optimizer", "scheduler"):  # nothing to step: DeepSpeed would build an optimizer from these
        config.pop(block, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("stage", 0) != 3:
        zero["stage"] = 0
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return frozen(engine)


def companion_parameters(companions: dict[str, Companion]) -> int:
    """Parameters of the companions (whole): for the memory estimate."""
    return sum(parameter_count(c.model) for c in companions.values())
