"""File names, manifest keys and the llama.cpp / GGUF facts the pipeline relies on."""

from gguf import Keys, LlamaFileType

from loraship.stage_table import STAGE_NAMES

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Stage order is the pipeline (loraship/stage_table.py); each stage writes into <workdir>/<run>/<stage>/.
STAGES = STAGE_NAMES

PLAN_FILE = "plan.json"
STRATEGY_FILE = "strategy.json"  # the part of the plan that training depends on
ADAPTER_DIR = "adapter"
CHECKPOINTS_DIR = "checkpoints"
LOSS_HISTORY_FILE = "loss_history.jsonl"
# The train stage's pictures (loraship/publishing/plots.py), outputs of its manifest.
LOSS_PLOT_FILE = "loss_curves.png"
MEMORY_PLOT_FILE = "memory_plan.png"
MERGED_DIR = "merged"
PROBE_FILE = "probe.json"
F16_GGUF = "model-F16.gguf"
REFERENCE_FILE = "reference.json"  # HF token ids, greedy answers + margins, tokenizer facts
REFERENCE_TOPK_FILE = "eval_topk.npz"  # HF top-k log-probs at every scored eval position
VERIFY_FILE = "verify.json"
MODEL_CARD = "README.md"
MODELFILE = "Modelfile"  # Ollama's build file, beside the GGUF in the artifact
GGUF_METADATA_FILE = "gguf_metadata.json"  # convert_hf_to_gguf.py --metadata override (general.name, ...)
OLLAMA_FILE = "ollama.json"  # chat-template family, default system prompt, stop tokens (loraship/llamacpp/ollama.py)


def quantized_gguf_name(quantization: str) -> str:
    return f"model-{quantization}.gguf"


# With adapter_gguf: the LoRA alone (convert_lora_to_gguf.py) and the base model it applies to.
ADAPTER_GGUF = "adapter-F16.gguf"


def base_gguf_name(quantization: str) -> str:
    return f"base-{quantization}.gguf"


# The one llama.cpp we ship with: convert, quantize and verify all use this pin.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# llama.cpp's llama_ftype values = GGUF general.file_type, from gguf-py (the format's own package).
GGUF_FILE_TYPES = {
    "F16": int(LlamaFileType.MOSTLY_F16), "Q8_0": int(LlamaFileType.MOSTLY_Q8_0),
    "Q4_K_M": int(LlamaFileType.MOSTLY_Q4_K_M), "Q5_K_M": int(LlamaFileType.MOSTLY_Q5_K_M),
}

# Approximate bits per weight of each quantization for a full model (llama.cpp's
# quantize README: Q4_K_M 4.84 on a 7B Llama).
BITS_PER_WEIGHT = {"Q4_K_M": 4.85, "Q5_K_M": 5.69, "Q8_0": 8.5, "F16": 16.0}

# GGUF metadata keys the stages read (gguf-py's Keys).
GGUF_KEY_FILE_TYPE = Keys.General.FILE_TYPE
GGUF_KEY_CHAT_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE
GGUF_KEY_BOS = Keys.Tokenizer.BOS_ID
GGUF_KEY_EOS = Keys.Tokenizer.EOS_ID
GGUF_KEY_ADD_BOS = Keys.Tokenizer.ADD_BOS
GGUF_KEY_PRE = Keys.Tokenizer.PRE

# Token texts llama.cpp treats as end-of-generation by name, besides the GGUF's eos/eot/eom ids
# (the `special_eog_ids` list in vendor/llama.cpp/src/llama-vocab.cpp of the pinned llama-cpp-python 0.3.36).
LLAMA_CPP_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
