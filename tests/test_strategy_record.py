"""The typed strategy record: read from a plan's JSON, written back byte for byte, described in one set of words."""

import json

import pytest

from loraship.planning.shape import shape_from_config
from loraship.planning.shipping import plan_disk_and_inference
from loraship.planning.strategy import plan_training, PlanRefused
from loraship.planning.strategy_record import ACTIVATIONS_IN_CPU, Strategy

# The two key orders plans carry today: Strategy.from_config's, and the ladder's rungs (offload_activations first).
AS_CONFIGURED = {
    "adapter": "lora",
    "offload_layers": 0,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 8,
    "fused_loss": True,
    "gradient_checkpointing": True,
    "offload_activations": False,
    "checkpointed_layers": 9,
}
RUNG = {
    "adapter": "lora",
    "offload_layers": 17,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "fused_loss": True,
    "offload_activations": True,
    "gradient_checkpointing": True,
    "checkpointed_layers": 40,
    "offload_spread": True,
}


@pytest.mark.parametrize("d", [AS_CONFIGURED, RUNG])
def test_a_strategy_is_written_back_as_the_same_bytes(d):
    st = Strategy.from_json(d)
    assert json.dumps(st.to_json()) == json.dumps(d)
    assert st.replace(micro_batch_size=1).to_json() == {**d, "micro_batch_size": 1}
    assert list(st.with_checkpointing(3).to_json()) == list(d)


def test_an_old_plan_is_upgraded_once_at_load():
    old = {
        "adapter": "qlora",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "fused_loss": False,
        "gradient_checkpointing": True,
    }
    assert Strategy.from_json(old, n_layers=28).checkpointed_layers == 28
    assert Strategy.from_json({**old, "gradient_checkpointing": False}, n_layers=28).checkpointed_layers == 0
    unknown = Strategy.from_json(old)  # the layer count unknown: every layer or none, resolved where it is known
    assert unknown.checkpointed_layers is None and unknown.checkpointed(12) == 12
    assert unknown.to_json() == old and unknown.offload_layers == 0 and not unknown.offload_activations
    assert unknown.describe(None).endswith("gradient checkpointing on")


def test_a_hand_edited_plan_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="offload_layer.*fix: re-plan"):
        Strategy.from_json({**AS_CONFIGURED, "offload_layer": 3})
    with pytest.raises(ValueError, match="lacks.*adapter"):
        Strategy.from_json({k: v for k, v in AS_CONFIGURED.items() if k != "adapter"})


def test_one_description_in_words():
    assert Strategy.from_json(AS_CONFIGURED).describe(28) == (
        "bf16 LoRA, micro-batch 2 x 8 accumulation, fused loss, gradient checkpointing 9 of 28 layers"
    )
    assert Strategy.from_json(RUNG).describe(48) == (
        "bf16 LoRA, 17 of 48 decoder layers' frozen weights streamed from CPU memory (spread over the first 40), "
        f"micro-batch 2 x 1 accumulation, fused loss, gradient checkpointing 40 of 48 layers, {ACTIVATIONS_IN_CPU}"
    )
    assert Strategy.from_json({**AS_CONFIGURED, "adapter": "qlora", "fused_loss": False}).describe(None) == (
        "QLoRA (NF4 base), micro-batch 2 x 8 accumulation, HF loss, gradient checkpointing 9 layers"
    )
    assert Strategy.from_json({**AS_CONFIGURED, "adapter": "qlora"}).base_precision == "NF4"


def test_the_plan_output_and_the_refusal_use_the_same_words():
    from rich.console import Console

    from loraship.cli import render_plan
    from loraship.config import parse_config

    mc = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    base = {
        "base_model": "m",
        "datasets": [{"path": "d.jsonl", "type": "chat"}],
        "sequence_len": 2048,
        "fused_loss": "on",
    }
    plan = plan_training(shape_from_config(mc), parse_config({**base, "gpu_memory_gib": 80}))
    con = Console(record=True, width=400)
    con.print(
        render_plan(plan, plan_disk_and_inference(shape_from_config(mc), parse_config({**base, "gpu_memory_gib": 80})))
    )
    assert f"Training plan: {Strategy.from_json(plan['strategy']).describe(8)}" in con.export_text()
    with pytest.raises(PlanRefused) as refused:
        plan_training(shape_from_config(mc), parse_config({**base, "gpu_memory_gib": 4, "fallback": []}))
    words = (
        "The smallest plan tried (bf16 LoRA, micro-batch 1 x 8 accumulation, fused loss, gradient checkpointing 8 of "
        f"8 layers, {ACTIVATIONS_IN_CPU}) needs"
    )
    assert words in str(refused.value)
