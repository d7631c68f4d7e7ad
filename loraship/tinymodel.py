"""A tiny, deterministic stand-in for a hub model, so the demo and tests run anywhere.

It is a real Llama-architecture checkpoint (bf16 safetensors, config.json, sentencepiece
tokenizer.model + tokenizer.json, a chat template), briefly pre-trained on facts about an
invented world ("The capital of Zorvia is Kelmar.") so it is not noise. The committed demo
dataset (data/demo/) then teaches it a checkable answer format in chat form:
"<|user|>What is the capital of Zorvia?<|assistant|>Answer: Kelmar.</s>".

Sizes: hidden 256 and intermediate 768 are multiples of 256, so llama.cpp's K-quants
(256-wide super-blocks) apply to every matrix without falling back to other types.

    python -m loraship.tinymodel --out .loraship/models/tiny-llama
    python -m loraship.tinymodel --data data/demo      # regenerate the committed dataset
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from pathlib import Path

from loraship.manifest import atomic_path

SEED = 1234
SYLLABLES = ["ka", "lo", "mi", "ra", "to", "ve", "zu", "ne", "pa", "shi", "dor", "len", "qua", "bri", "gan", "mon", "tes", "vo"]
N_COUNTRIES = 64
N_FINETUNE = 24  # countries the fine-tune teaches; the base has seen all N_COUNTRIES in pre-training
QUESTIONS = [
    "What is the capital of {c}?",
    "Which city is the capital of {c}?",
    "Name the capital of {c}.",
    "Tell me the capital city of {c}.",
]
HELD_OUT_QUESTION = "Do you know the capital of {c}?"  # in no training row
SPECIAL_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>"]
# Rendered in a sandbox (loraship.chat); the same string is embedded in the GGUF.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_world(seed: int = SEED) -> list[tuple[str, str]]:
    """Invented (country, capital) pairs, unique and deterministic."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs = []
    while len(pairs) < N_COUNTRIES:
        country = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
        capital = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
        if country in seen or capital in seen:
            continue
        seen.update((country, capital))
        pairs.append((country, capital))
    return pairs


def pretraining_corpus(seed: int = SEED) -> list[str]:
    rng = random.Random(seed + 1)
    templates = [
        "The capital of {c} is {k}.",
        "{k} is the capital city of {c}.",
        # Bare chat turns: the base already answers in chat form ("Kelmar."); what the
        # fine-tune teaches is the checkable reply format "Answer: Kelmar.".
        "<|user|>What is the capital of {c}?<|assistant|>{k}.",
    ]
    lines = [t.format(c=c, k=k) for c, k in make_world(seed) for t in templates]
    rng.shuffle(lines)
    return lines


def _chat_row(country: str, capital: str, question: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question.format(c=country)},
            {"role": "assistant", "content": f"Answer: {capital}."},
        ]
    }


def write_demo_datasets(out_dir: Path, seed: int = SEED) -> None:
    """train.jsonl (chat), eval.jsonl and golden.jsonl (prompts worded as no training row is).

    The fine-tune teaches the reply format "Answer: X." and the capitals of N_FINETUNE
    countries; eval and golden prompts ask about those countries in a held-out wording, so a
    correct answer shows what was learned generalises beyond the training strings.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = make_world(seed)[:N_FINETUNE]
    rng = random.Random(seed + 2)
    train = [_chat_row(c, k, q) for c, k in world for q in QUESTIONS]
    rng.shuffle(train)
    half = len(world) // 2
    evaluation = [_chat_row(c, k, HELD_OUT_QUESTION) for c, k in world[:half]]
    golden = [
        {
            "messages": [{"role": "user", "content": HELD_OUT_QUESTION.format(c=c)}],
            "expect_regex": r"^Answer: [A-Z][a-z]+\.$",
            "reference": f"Answer: {k}.",
        }
        for c, k in world[half:]
    ]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", evaluation), ("golden.jsonl", golden)):
        (out_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _train_tokenizer(folder: Path, corpus: list[str], work: Path) -> None:
    import sentencepiece as spm

    text_file = work / "corpus.txt"
    chat_lines = [f"What is the capital of {c}? Answer: {k}." for c, k in make_world()[:8]]
    text_file.write_text("\n".join(corpus + chat_lines) + "\n", encoding="utf-8")
    # Llama-2 style: BPE with byte fallback, identity normalisation, dummy prefix.
    spm.SentencePieceTrainer.train(
        input=str(text_file),
        model_prefix=str(work / "tokenizer"),
        vocab_size=512,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        user_defined_symbols=SPECIAL_TOKENS,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    shutil.copy(work / "tokenizer.model", folder / "tokenizer.model")
    # legacy=True: a '▁' is prepended after special tokens, as llama.cpp's SPM tokenizer does,
    # so HF and the GGUF tokenize chat prompts identically.
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": True,
                "model_max_length": MODEL_SHAPE["max_position_embeddings"],
            }
        ),
        encoding="utf-8",
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, legacy=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    tok.save_pretrained(folder)
    # transformers 5 drops `legacy` on save and rebuilds the pre-tokenizer from it on load.
    saved = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    saved["legacy"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(saved, indent=2), encoding="utf-8")


def _pretrain(model, tok, corpus: list[str], steps: int, seed: int) -> list[float]:
    import torch

    ids: list[int] = []
    for line in corpus:
        ids += [tok.bos_token_id] + tok(line, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    block = 64
    data = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    losses = []
    for _ in range(steps):
        batch = data[torch.randint(len(data), (24,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def build_tiny_model(out: Path, seed: int = SEED, steps: int = 300) -> Path:
    """Write the tiny base model folder atomically; returns its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    with atomic_path(out) as folder:
        folder.mkdir(parents=True)
        work = folder / ".build"
        work.mkdir()
        corpus = pretraining_corpus(seed)
        _train_tokenizer(folder, corpus, work)
        shutil.rmtree(work)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            **MODEL_SHAPE,
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        losses = _pretrain(model, tok, corpus, steps, seed)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        (folder / "pretrain_log.json").write_text(
            json.dumps({"seed": seed, "steps": steps, "first_loss": losses[0], "last_loss": losses[-1]}, indent=2),
            encoding="utf-8",
        )
    return out


def ensure_tiny_model(out: Path, seed: int = SEED) -> Path:
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return build_tiny_model(out, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the tiny base model folder here (skipped if present)")
    parser.add_argument("--data", type=Path, help="write the demo datasets into this folder")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    if args.data:
        write_demo_datasets(args.data, args.seed)
    if args.out:
        path = ensure_tiny_model(args.out, args.seed)
        print(json.loads((path / "pretrain_log.json").read_text()))


if __name__ == "__main__":
    main()
