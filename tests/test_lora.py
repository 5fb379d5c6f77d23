"""LoRA (infra.lora): only the adapter trains, checkpoints hold it alone and resume exactly
(tests/test_recipes.py), and the export (merged or
the adapter alone) computes what the adapted model did."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.lora import LoraArguments, with_lora

LORA = LoraArguments(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


@pytest.fixture
def base(tmp_path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def adapted(base: Path):
    from transformers import AutoModelForCausalLM

    return with_lora(AutoModelForCausalLM.from_pretrained(base), LORA, "CAUSAL_LM")


def trained(model, steps: int = 3):
    from infra.optim import OptimizerConfig, build_optimizer

    optimizer = build_optimizer(model, OptimizerConfig(learning_rate=1e-2))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == sum(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, ids


def test_only_the_adapter_trains(base):
    model = adapted(base)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trained(model)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    lora = {name for name, _ in model.named_parameters() if ".lora_" in name}
    assert lora and changed == {name for name in lora if ".lora_B." in name or ".lora_A." in name}
    assert {name for name, p in model.named_parameters() if p.requires_grad} == lora


def test_both_exports_compute_what_the_adapted_model_did(base, tiny_data, tmp_path):
    """final/ as the adapter alone (peft loads it onto the base) and merged (from_pretrained): the adapted model's logits."""
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.export import Exporter

    model, ids = trained(adapted(base))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    accelerator, tokenizer = Accelerator(cpu=True), AutoTokenizer.from_pretrained(tiny_data / "tokenizer")
    adapter = Exporter(accelerator, tmp_path / "a", "sft_clm", tokenizer, "text-generation", {}, adapter_only=True).export(model, {})
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    merged = Exporter(accelerator, tmp_path / "m", "sft_clm", tokenizer, "text-generation", {}).export(model, {})
    with torch.no_grad():
        from_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)(input_ids=ids).logits
        from_merged = AutoModelForCausalLM.from_pretrained(merged)(input_ids=ids).logits
    assert torch.equal(from_adapter, expected)
    assert torch.allclose(from_merged, expected, atol=1e-5)
    assert not any("lora" in name for name in load_file(merged / "model.safetensors"))


@pytest.mark.parametrize("engine", ["DEEPSPEED", "FSDP"])
def test_lora_under_zero_or_fsdp_is_refused_in_one_line(base, engine):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from infra.lora import check_engine

    accelerator = SimpleNamespace(distributed_type=DistributedType[engine])
    assert check_engine(accelerator, adapted(base)) == (
        f"use_peft runs under DDP or one process here, not {DistributedType[engine].value}: use cpu.yaml or ddp.yaml"
    )
    assert check_engine(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), adapted(base)) is None
