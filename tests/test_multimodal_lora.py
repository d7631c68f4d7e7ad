"""A multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration) trains its language model only: the plan says
the vision tower is not trained (plan.json model.untrained_modules), and its Linears share the language model's
names (q_proj, ...), so LoRA must be kept off them by name."""

from __future__ import annotations


def _tiny_gemma3_multimodal(folder):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
    from transformers.models.siglip.configuration_siglip import SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        sliding_window=16,
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=500,
        eoi_token_index=501,
        image_token_index=502,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    Gemma3ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def test_lora_stays_off_the_vision_tower(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraship.planning.shape import shape_from_config
    from loraship.training.lora_targets import lora_excluded

    folder = _tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    import json

    shape = shape_from_config(json.loads((folder / "config.json").read_text()))
    assert shape.untrained_modules  # the plan names the vision tower
    model = AutoModelForCausalLM.from_pretrained(folder)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        exclude_modules=lora_excluded(folder),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_modules() if n.endswith(".lora_A")}
    assert adapted and all(".language_model." in n for n in adapted), sorted(adapted)
    assert len(adapted) == 2 * 4  # both decoder layers' q, k, v, o
