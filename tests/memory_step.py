"""One Llama training step, measured: the rise of the peak resident memory from before the model was built, over two
AdamW steps (the second holds the moments), and the memory estimate (infra.memory) of the same step, as JSON.

    MALLOC_MMAP_THRESHOLD_=131072 python tests/memory_step.py HIDDEN LAYERS INTERMEDIATE HEADS BATCH SEQ_LEN on|off fp32|bf16

Run it with MALLOC_MMAP_THRESHOLD_ fixed, so that freed tensors go back to the kernel as a GPU's caching allocator
would reuse them: otherwise glibc keeps them, and the resident memory counts what was freed long ago. Linux only.
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from infra.memory import Setup, Shape, estimate


def status(key: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024


def main(hidden, layers, intermediate, heads, batch, seq_len, checkpointing, precision) -> None:
    checkpointing, bf16 = checkpointing == "on", precision == "bf16"
    config = AutoConfig.for_model(
        "llama",
        vocab_size=4096,
        hidden_size=int(hidden),
        intermediate_size=int(intermediate),
        num_hidden_layers=int(layers),
        num_attention_heads=int(heads),
        tie_word_embeddings=True,
    )
    batch, seq_len = int(batch), int(seq_len)
    base = status("VmRSS:")
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as the recipes (infra.optim)
    ids = torch.randint(0, 4096, (batch, seq_len))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    setup = Setup(bf16=bf16, checkpointing=checkpointing, device="cpu")
    guess = sum(estimate(Shape.of(model, batch, seq_len, causal_lm=True), setup).values())
    print(json.dumps({"measured": status("VmHWM:") - base, "estimate": guess}))


if __name__ == "__main__":
    main(*sys.argv[1:])
