"""File names, manifest keys and the llama.cpp / GGUF facts the pipeline relies on."""

from dataclasses import dataclass

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
# verify's picture of the quantizations it verified (quantization auto or several listed): size against KL.
LADDER_PLOT_FILE = "quant_ladder.png"
MERGED_DIR = "merged"
GENERATION_CONFIG_FILE = "generation_config.json"  # transformers' decoding settings (merged model, artifact)
PROBE_FILE = "probe.json"
F16_GGUF = "model-F16.gguf"
# quantize's importance matrix (llama-imatrix's GGUF format) and the training texts it was computed from.
IMATRIX_FILE = "imatrix.gguf"
IMATRIX_TEXT_FILE = "imatrix-calibration.txt"
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
    "F16": int(LlamaFileType.MOSTLY_F16),
    "Q8_0": int(LlamaFileType.MOSTLY_Q8_0),
    "Q6_K": int(LlamaFileType.MOSTLY_Q6_K),
    "Q5_K_M": int(LlamaFileType.MOSTLY_Q5_K_M),
    "Q5_K_S": int(LlamaFileType.MOSTLY_Q5_K_S),
    "Q4_K_M": int(LlamaFileType.MOSTLY_Q4_K_M),
    "Q4_K_S": int(LlamaFileType.MOSTLY_Q4_K_S),
    "IQ4_XS": int(LlamaFileType.MOSTLY_IQ4_XS),
    "Q3_K_L": int(LlamaFileType.MOSTLY_Q3_K_L),
    "Q3_K_M": int(LlamaFileType.MOSTLY_Q3_K_M),
    "IQ3_M": int(LlamaFileType.MOSTLY_IQ3_M),
}

# Bits per weight of each quantization for a whole model: the file sizes llama.cpp's quantize tool
# lists for Llama-3-8B (8.03e9 weights; tools/quantize/quantize.cpp in the pinned sdist), x 8 bits
# / weights; IQ4_XS and IQ3_M from their nominal bpw plus the K-quant mixes' overhead (Q4_K_M: 4.58 GiB
# ~ 4.85 bpw).
BITS_PER_WEIGHT = {
    "Q8_0": 8.5,
    "Q6_K": 6.57,
    "Q5_K_M": 5.69,
    "Q5_K_S": 5.57,
    "Q4_K_M": 4.85,
    "Q4_K_S": 4.67,
    "IQ4_XS": 4.5,
    "Q3_K_L": 4.31,
    "Q3_K_M": 4.0,
    "IQ3_M": 3.9,
    "F16": 16.0,
}


@dataclass(frozen=True)
class QuantGate:
    """One of verify's default quality limits for a quantization: the config field that overrides it, the gate in
    verify.json it limits, the limit, whether the measured figure must stay at or under it ("max") or at or over it
    ("min"), and where the number comes from."""

    name: str  # the config field (kl_mean_max); Config.gate_limits reads it
    metric: str  # the gate verify.json reports (loraship/verification/gates.py)
    limit: float
    direction: str  # "max" or "min"
    why: str

    def passes(self, value: float) -> bool:
        return value <= self.limit if self.direction == "max" else value >= self.limit


def _quant_gates(kl_mean: float, kl_p99: float, same_top: float, ppl_ratio: float, flips: float) -> tuple:
    return (
        QuantGate("kl_mean_max", "kl_divergence_mean", kl_mean, "max", "about 3x llama.cpp's mean KLD for it"),
        QuantGate("kl_p99_max", "kl_divergence_p99", kl_p99, "max", "the worst 1% of tokens, 8-10x the mean's limit"),
        QuantGate("same_top_min", "same_top_token", same_top, "min", "5-7 points under llama.cpp's same-top rate"),
        QuantGate(
            "perplexity_ratio_max", "perplexity_ratio", ppl_ratio, "max", "llama.cpp's excess x 3-4, at least +2%"
        ),
        QuantGate(
            "decisive_flips_max",
            "golden_decisive_agreement",
            flips,
            "max",
            "share of decisive golden tokens it may flip: none at 5 bits and up",
        ),
    )


# verify's default quality gates per quantization (config fields left unset take these). Calibrated on
# llama.cpp's own scoreboard, Llama-3-8B on wikitext, no imatrix (tools/perplexity/README.md in the pinned
# sdist: mean KLD Q8_0 0.00136, Q6_K 0.00545, Q5_K_M 0.0108, Q5_K_S 0.0166, Q4_K_M 0.0313, Q4_K_S 0.0431,
# Q3_K_L 0.0872, Q3_K_M 0.102; same top token Q8_0 97.7%, Q6_K 96.0%, Q4_K_M 91.9%; PPL ratio Q8_0 1.0004,
# Q6_K 1.0035, Q4_K_M 1.028, Q3_K_M 1.105), a model family known to quantize badly: kl_mean_max is about
# 3x its mean KLD (smaller models and short eval splits scatter more), same_top_min about 5-7 points
# under its rate, perplexity_ratio_max its excess x 3-4 (at least +2%). IQ4_XS sits between Q4_K_S and
# Q4_K_M, IQ3_M near Q3_K_M. bench/results/quant_ladder.json measures the same figures on the real SmolLM2.
# decisive_flips_max: the share of decisive golden-answer tokens (golden_margin) a 4-bit or coarser GGUF may
# pick differently; 5 bits and up must pick them all (the real SmolLM2: 0/45 flips at every rung but Q3_K_M, 1/45).
QUANT_GATES: dict[str, tuple[QuantGate, ...]] = {
    #                        kl_mean_max, kl_p99_max, same_top_min, perplexity_ratio_max, decisive_flips_max
    "Q8_0": _quant_gates(0.005, 0.05, 0.95, 1.02, 0.0),
    "Q6_K": _quant_gates(0.02, 0.2, 0.93, 1.03, 0.0),
    "Q5_K_M": _quant_gates(0.035, 0.35, 0.9, 1.05, 0.0),
    "Q5_K_S": _quant_gates(0.05, 0.5, 0.89, 1.06, 0.0),
    "Q4_K_M": _quant_gates(0.1, 1.0, 0.85, 1.1, 0.025),
    "Q4_K_S": _quant_gates(0.13, 1.2, 0.84, 1.12, 0.025),
    "IQ4_XS": _quant_gates(0.12, 1.1, 0.84, 1.12, 0.025),
    "Q3_K_L": _quant_gates(0.26, 2.0, 0.78, 1.25, 0.05),
    "Q3_K_M": _quant_gates(0.3, 2.2, 0.77, 1.3, 0.05),
    "IQ3_M": _quant_gates(0.3, 2.2, 0.77, 1.3, 0.05),
}

# Quantizations whose GGUF an importance matrix cannot change: llama.cpp's quantize_q8_0 ignores its quant_weights
# ("(void)quant_weights; // not used", ggml/src/ggml-quants.c of the pinned sdist) and F16 is not quantized, so a run
# that makes only these skips llama-imatrix.
IMATRIX_UNUSED = frozenset({"Q8_0", "F16"})

# quantization: auto tries these, smallest file first (BITS_PER_WEIGHT), and ships the first that passes.
AUTO_LADDER = ("IQ3_M", "Q3_K_M", "IQ4_XS", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")

# GGUF metadata keys the stages read (gguf-py's Keys).
GGUF_KEY_FILE_TYPE = Keys.General.FILE_TYPE
GGUF_KEY_CHAT_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE
GGUF_KEY_BOS = Keys.Tokenizer.BOS_ID
GGUF_KEY_EOS = Keys.Tokenizer.EOS_ID
GGUF_KEY_ADD_BOS = Keys.Tokenizer.ADD_BOS
GGUF_KEY_PRE = Keys.Tokenizer.PRE

# Token texts llama.cpp treats as end-of-generation by name, besides the GGUF's eos/eot/eom ids
# (the `special_eog_ids` list in vendor/llama.cpp/src/llama-vocab.cpp of the pinned llama-cpp-python 0.3.36).
LLAMA_CPP_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
