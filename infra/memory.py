"""Will it fit? An estimate, per rank, of what training holds on the device, against its free memory, before step 1.

    weights      4 B per parameter (fp32 master weights; DeepSpeed in bf16: 2 B), + 2 B under bf16 autocast (its
                 cache of bf16 copies), divided by the world size under ZeRO-3 and FSDP full sharding
    gradients    4 B per trainable parameter (DeepSpeed bf16: 2 B); + 4 B more for DDP's buckets; / world size from ZeRO-2
    optimizer    AdamW: 8 B per trainable parameter (DeepSpeed bf16: 12 B, with the fp32 master); / world size from
                 ZeRO-1 and under FSDP; 0 on the device when offloaded
    activations  per layer and token of a micro-batch: (40 x hidden + 16 x intermediate) B in fp32, 0.75 of that
                 under bf16 autocast (norms and the residual stream stay fp32); eager attention adds the heads' s x s
                 scores; a causal LM adds its logits and their log-softmax (vocab x 8 B per token in fp32, 10 B in
                 bf16). With activation checkpointing: each layer's input, plus the larger of one layer and the logits.
    companions   frozen models beside it (DPO's reference): 4 B per parameter (DeepSpeed bf16: 2 B), divided by the
                 world size under ZeRO-3 and FSDP full sharding, as they are placed (infra.companions)
    runtime      1 GiB on a GPU (CUDA context, NCCL buffers), 0.1 GiB on a CPU

The coefficients were measured on CPU (peak resident memory of a Llama training step, tests/test_memory.py checks
15 %); autocast and transformers' modules keep the same tensors on a GPU. On a CPU, the free memory is shared by the
machine's ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

GIB = 1 << 30
RUNTIME = {"cuda": 1.0 * GIB, "cpu": 0.1 * GIB}


def parameter_count(model: torch.nn.Module, trainable: bool = False) -> int:
    """A model's parameters, whole (only those that train, if asked). Under ZeRO-3 transformers loads a model already
    partitioned: each parameter is then an empty placeholder, and its size is `ds_numel`."""
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters() if p.requires_grad or not trainable)


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of the model and of one micro-batch."""

    parameters: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    batch: int  # samples per micro-batch per rank
    seq_len: int
    vocab: int | None = None  # a causal LM's logits; None for a classifier (its logits are negligible)
    eager_attention: bool = False  # the s x s scores are kept (sdpa, flash and flex kernels keep none)
    companions: int = 0  # parameters of frozen models beside it (a DPO reference: infra.job.Companion)

    @classmethod
    def of(cls, model: torch.nn.Module, batch: int, seq_len: int, causal_lm: bool) -> Shape:
        """From a transformers model (built, or on the meta device: nothing is allocated)."""
        c = model.config
        return cls(
            parameters=parameter_count(model),
            trainable=parameter_count(model, trainable=True),
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            intermediate=getattr(c, "intermediate_size", 4 * c.hidden_size),
            heads=c.num_attention_heads,
            batch=batch,
            seq_len=seq_len,
            vocab=c.vocab_size if causal_lm else None,
            eager_attention=getattr(c, "_attn_implementation", None) == "eager",
        )


@dataclass(frozen=True)
class Setup:
    """How the job trains: engine, its sharding and offload, precision, checkpointing, the device."""

    world_size: int = 1
    engine: str = "ddp"  # ddp, zero1, zero2, zero3, fsdp (full sharding), fsdp_grad_op (parameters kept whole)
    offload_optimizer: bool = False
    offload_parameters: bool = False
    bf16: bool = False
    checkpointing: bool = False
    device: str = "cuda"

    @classmethod
    def of(cls, accelerator: Accelerator, checkpointing: bool) -> Setup:
        state, kind = accelerator.state, accelerator.distributed_type
        engine, offload_optimizer, offload_parameters = "ddp", False, False
        if kind == DistributedType.DEEPSPEED:
            plugin = state.deepspeed_plugin
            engine = f"zero{plugin.zero_stage}" if plugin.zero_stage else "ddp"
            offload_optimizer = plugin.offload_optimizer_device in ("cpu", "nvme")
            offload_parameters = plugin.offload_param_device in ("cpu", "nvme")
        elif kind == DistributedType.FSDP:
            plugin = state.fsdp_plugin
            engine = "fsdp" if getattr(plugin, "reshard_after_forward", True) not in (False, "SHARD_GRAD_OP") else "fsdp_grad_op"
            offload_optimizer = offload_parameters = bool(getattr(plugin.cpu_offload, "offload_params", False))
        return cls(
            world_size=accelerator.num_processes,
            engine=engine,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            bf16=accelerator.mixed_precision == "bf16",
            checkpointing=checkpointing,
            device=accelerator.device.type,
        )


def estimate(shape: Shape, setup: Setup) -> dict[str, float]:
    """Bytes per rank on the device: weights, gradients, optimizer, activations, runtime."""
    deepspeed = setup.engine.startswith("zero")
    world, n, trainable = setup.world_size, shape.parameters, shape.trainable
    weight_bytes, grad_bytes, state_bytes = (2, 2, 12) if deepspeed and setup.bf16 else (4, 4, 8)
    weights = n * weight_bytes + (2 * n if setup.bf16 and not deepspeed else 0)
    gradients = trainable * grad_bytes * (2 if setup.engine == "ddp" and world > 1 else 1)
    optimizer = trainable * state_bytes
    if setup.engine in ("zero1", "zero2", "zero3", "fsdp", "fsdp_grad_op"):
        optimizer /= world
    if setup.engine in ("zero2", "zero3", "fsdp", "fsdp_grad_op"):
        gradients /= world
    if setup.engine in ("zero3", "fsdp"):
        weights /= world
    if setup.offload_optimizer:
        optimizer = 0.0
    # a frozen companion: its weights only (DeepSpeed bf16 holds them in bf16), sharded where the weights are
    companions = shape.companions * (2 if deepspeed and setup.bf16 else 4) / (world if setup.engine in ("zero3", "fsdp") else 1)
    if setup.offload_parameters:
        weights = companions = 0.0
    return {
        "weights": weights,
        **({"companions": companions} if shape.companions else {}),
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": activations(shape, setup),
        "runtime": RUNTIME.get(setup.device, RUNTIME["cuda"]),
    }


def activations(shape: Shape, setup: Setup) -> float:
    tokens = shape.batch * shape.seq_len
    per_token = (40 * shape.hidden + 16 * shape.intermediate) * (0.75 if setup.bf16 else 1.0)
    layer = tokens * per_token
    if shape.eager_attention:
        layer += shape.batch * shape.heads * shape.seq_len**2 * (6 if setup.bf16 else 8)
    logits = tokens * shape.vocab * (10 if setup.bf16 else 8) if shape.vocab else 0.0
    if setup.checkpointing:
        return shape.layers * tokens * shape.hidden * 4 + max(layer, logits)
    return shape.layers * layer + logits


def levers(shape: Shape, setup: Setup) -> dict[str, float]:
    """What the total would be with each lever that is not on yet."""
    options = {}
    if not setup.checkpointing:
        options["gradient_checkpointing: true"] = replace(setup, checkpointing=True)
    if setup.world_size > 1 and setup.engine not in ("zero3", "fsdp"):
        options["accelerate_configs/fsdp.yaml or zero3.yaml (shard everything)"] = replace(setup, engine="fsdp")
    if not setup.offload_optimizer and setup.engine.startswith("zero"):
        options["offload_optimizer_device: cpu (zero3_offload.yaml)"] = replace(setup, offload_optimizer=True)
    out = {name: sum(estimate(shape, s).values()) for name, s in options.items()}
    if shape.batch > 1:
        half = replace(shape, batch=shape.batch // 2)
        out["half the per_device_train_batch_size, twice the gradient_accumulation_steps"] = sum(estimate(half, setup).values())
    return out


def usable_memory(device: torch.device, local_ranks: int, model: torch.nn.Module) -> float:
    """Bytes this rank may use in all: what it holds already (the model is prepared: allocated, sharded) plus the GPU's
    free memory, or on a CPU the machine's available memory shared by its ranks."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device))
    import psutil

    held = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)  # an FSDP2 shard
        held += local.numel() * local.element_size()
    return psutil.virtual_memory().available / max(local_ranks, 1) + held


def rank_memory(accelerator: Accelerator, model: torch.nn.Module) -> float:
    """What this rank may use in all (usable_memory), its machine's ranks counted."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))  # on this machine
    return usable_memory(accelerator.device, local_ranks, model)


def most_samples(shape: Shape, setup: Setup, usable: float) -> int:
    """The most samples of a micro-batch that fit in `usable` bytes by the estimate: its activations grow with them, the
    rest does not."""
    one, two = (sum(estimate(replace(shape, batch=b), setup).values()) for b in (1, 2))
    return max(0, int((usable - (2 * one - two)) // (two - one)))


def sample_caps(accelerator: Accelerator, model: torch.nn.Module, shape: Shape, setup: Setup) -> list[int]:
    """Each rank's most samples of a micro-batch (most_samples), gathered: the same list on every rank, which bounds
    the shares rebalancing gives (infra.shares.rebalanced)."""
    mine = most_samples(shape, setup, rank_memory(accelerator, model))
    if accelerator.num_processes == 1:
        return [mine]
    from accelerate.utils import gather_object

    return gather_object([mine])


def table(rows: dict[str, float], free: float) -> str:
    total = sum(rows.values())
    lines = [f"  {name:<12}{value / GIB:>9.2f} GiB" for name, value in rows.items()]
    lines += [f"  {'total':<12}{total / GIB:>9.2f} GiB of {free / GIB:.2f} GiB free per rank ({total / free:.0%})"]
    return "\n".join(lines)


def refusal(shape: Shape, setup: Setup, free: float) -> str | None:
    """One line when the estimate exceeds the free memory (what this rank may use in all): the numbers and the levers
    that would make it fit."""
    total = sum(estimate(shape, setup).values())
    if total <= free:
        return None
    options = sorted(levers(shape, setup).items(), key=lambda kv: kv[1])
    fits = [f"{name} (~{value / GIB:.1f} GiB)" for name, value in options if value <= free]
    if fits:
        hint = "; it would fit with " + ", or ".join(fits)
    else:
        best, value = options[0] if options else ("none", total)
        hint = f"; no single lever fits it (the best, {best}, gives ~{value / GIB:.1f} GiB): combine them, or use larger devices"
    return f"the estimate is {total / GIB:.1f} GiB per rank and {free / GIB:.1f} GiB is free{hint}"
