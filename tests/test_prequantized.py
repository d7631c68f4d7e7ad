"""A base stored 4-bit by bitsandbytes (a -bnb-4bit folder): trained as QLoRA on its own NF4 weights, merged into
those weights dequantized, and refused in one message where it cannot go."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest
import torch

from loraship.config import parse_config
from loraship.errors import ConfigError
from loraship.runtime.stage import stage_dir
from tests.conftest import demo_config_dict


@pytest.fixture(scope="module")
def bnb_4bit_base(tiny_model, tmp_path_factory):
    """The tiny model as transformers saves it loaded with load_in_4bit (what -bnb-4bit repositories hold), with the
    base's own tokenizer files."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = tmp_path_factory.mktemp("bnb") / "tiny-llama-bnb-4bit"
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model, quantization_config=q, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def run_stages(config, stages):
    return {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in stages}


def test_a_4bit_base_trains_as_qlora_and_merges_into_its_dequantized_weights(bnb_4bit_base, tmp_path):
    from bitsandbytes.functional import dequantize_4bit
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = parse_config(
        demo_config_dict(bnb_4bit_base, tmp_path, run_name="bnb", adapter="qlora", max_steps=4, warmup_steps=1)
    )
    merged = run_stages(config, ["plan", "train", "merge"])["merge"]["metrics"]
    assert merged["base_weights"] == "nf4 dequantized to bf16 (pre-quantized base)"
    assert merged["merge_matches_adapter"] and merged["merge_differs_from_base"]

    out = stage_dir(config, "merge") / "merged"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    weights = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert not [k for k in weights if ".absmax" in k or "quant_state" in k or "quant_map" in k]
    # One module by hand: bitsandbytes' own dequantization of the loaded 4-bit weight, plus scale x B @ A.
    base = AutoModelForCausalLM.from_pretrained(bnb_4bit_base, dtype=torch.bfloat16)
    q = base.model.layers[1].self_attn.q_proj.weight
    nf4 = dequantize_4bit(q.data, q.quant_state).float()
    adapter = load_file(stage_dir(config, "train") / "adapter" / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    a, b = adapter[f"{prefix}.lora_A.weight"].float(), adapter[f"{prefix}.lora_B.weight"].float()
    scale = config.lora_alpha / config.lora_r
    want = (nf4 + scale * (b @ a)).to(torch.bfloat16)
    got = weights["model.layers.1.self_attn.q_proj.weight"]
    assert got.shape == want.shape and torch.equal(got, want)
    assert not torch.equal(got, nf4.to(torch.bfloat16))  # the adapter moved it


def _eight_bit(folder, tmp_path):
    copy = tmp_path / "tiny-llama-bnb-8bit"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def _per_expert(folder, tmp_path):
    """The 4-bit base with one expert Linear packed on its own, as MoE checkpoints quantized before transformers v5
    store every expert (mlp.experts.<i>.<proj>.weight and its quantization state)."""
    from safetensors.torch import save_file

    copy = tmp_path / "moe-bnb-4bit-per-expert"
    shutil.copytree(folder, copy)
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    tensors = {name: torch.zeros(64, 1, dtype=torch.uint8), f"{name}.quant_state.bitsandbytes__nf4": torch.zeros(8)}
    save_file(tensors, str(copy / "model-experts.safetensors"), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize(
    "case,adapter,message",
    [
        ("4bit", "lora", "stored 4-bit by bitsandbytes (quantization_config load_in_4bit): its weights exist only"),
        ("4bit", "lora", "fix: set adapter: qlora, or point base_model at the bf16 original"),
        ("8bit", "qlora", "stored 8-bit by bitsandbytes (quantization_config load_in_8bit), which loraship cannot"),
        ("8bit", "lora", "fix: point base_model at the bf16 original, or at its 4-bit (-bnb-4bit) version"),
        ("per-expert", "qlora", "stores its experts as separate 4-bit Linears (model.layers.0.mlp.experts.3.gate_pro"),
        ("per-expert", "qlora", "fix: point base_model at the bf16 original (under adapter: qlora loraship stores"),
    ],
)
def test_a_prequantized_base_it_cannot_train_is_one_message_at_plan(bnb_4bit_base, tmp_path, case, adapter, message):
    make = {"4bit": lambda f, _t: f, "8bit": _eight_bit, "per-expert": _per_expert}[case]
    base = make(bnb_4bit_base, tmp_path)
    config = parse_config(demo_config_dict(base, tmp_path, run_name="bad", adapter=adapter))
    with pytest.raises(ConfigError) as e:
        run_stages(config, ["plan"])
    assert message in str(e.value)
    assert not stage_dir(config, "train").exists()
