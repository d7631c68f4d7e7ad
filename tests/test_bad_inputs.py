"""Bad input: a clear message naming the problem and the fix, exit code != 0, no traceback."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import tarfile
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def fake_model(root: Path) -> Path:
    """Enough of a model folder for the checks that run before any loading."""
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def good_dataset(root: Path) -> Path:
    path = root / "train.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _missing_base(cfg, root):
    cfg["base_model"] = str(root / "no-such-model")


def _missing_dataset(cfg, root):
    cfg["datasets"][0]["path"] = str(root / "nope.jsonl")


def _malformed_line(cfg, root):
    good = (root / "train.jsonl").read_text()
    cfg["datasets"][0]["path"] = str(write(root / "bad.jsonl", good + good + '{"messages": [\n'))


def _empty_dataset(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "empty.jsonl", "\n\n"))


def _unknown_type(cfg, root):
    cfg["datasets"][0]["type"] = "oasst"


def _unknown_quant(cfg, root):
    cfg["quantization"] = "Q3_K_XL"


def _unwritable_output(cfg, root):
    blocker = write(root / "a-file", "not a folder")
    cfg["output"] = str(blocker / "artifacts")


def _non_utf8(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1")))
    cfg["datasets"][0]["type"] = "completion"


def _missing_fields(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "alpaca.jsonl", json.dumps({"instruction": "x"}) + "\n"))
    cfg["datasets"][0]["type"] = "alpaca"


def _no_tokenizer(cfg, root):
    (Path(cfg["base_model"]) / "tokenizer.json").unlink()


def _pickle_only(cfg, root):
    (Path(cfg["base_model"]) / "model.safetensors").unlink()
    write(Path(cfg["base_model"]) / "pytorch_model.bin", b"\x80\x04")


def _unknown_key(cfg, root):
    cfg["lora_rank"] = 8


def _out_of_range(cfg, root):
    cfg["lora_r"] = 0
    cfg["lora_dropout"] = 1.5


def _no_config_json(cfg, root):
    (Path(cfg["base_model"]) / "config.json").unlink()


def _unsupported_architecture(cfg, root):
    (Path(cfg["base_model"]) / "config.json").write_text(
        json.dumps({"architectures": ["FrobnicatorForCausalLM"], "model_type": "frobnicator"})
    )


def _chat_without_assistant(cfg, root):
    row = {"messages": [{"role": "user", "content": "hi"}]}
    cfg["datasets"][0]["path"] = str(write(root / "noanswer.jsonl", json.dumps(row) + "\n"))


def _chat_bad_role(cfg, root):
    row = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    cfg["datasets"][0]["path"] = str(write(root / "role.jsonl", json.dumps(row) + "\n"))


def _remote_code(cfg, root):
    (Path(cfg["base_model"]) / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "auto_map": {"AutoModelForCausalLM": "modeling_x.X"},
            }
        )
    )


def _warmup_too_long(cfg, root):
    cfg["warmup_steps"] = 10
    cfg["max_steps"] = 5


def _bad_golden_regex(cfg, root):
    row = {"prompt": "hi", "expect_regex": "(unclosed"}
    cfg["golden_prompts"] = str(write(root / "golden.jsonl", json.dumps(row) + "\n"))


def _run_name_escape(cfg, root):
    cfg["run_name"] = "../../etc"


def _negative_learning_rate(cfg, root):
    cfg["learning_rate"] = -0.1


def _chat_ends_with_user(cfg, root):
    row = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and then?"},
        ]
    }
    cfg["datasets"][0]["path"] = str(write(root / "trailing.jsonl", json.dumps(row) + "\n"))


def _chat_role_unknown_to_template(cfg, root):
    row = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "tool", "content": "{}"},
            {"role": "assistant", "content": "yo"},
        ]
    }
    cfg["datasets"][0]["path"] = str(write(root / "tool.jsonl", json.dumps(row) + "\n"))


def _duplicate_yaml_key(cfg, root):
    return yaml.safe_dump(cfg) + "lora_r: 64\nlora_r: 8\n"


def _yaml_alias_bomb(cfg, root):
    levels = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return yaml.safe_dump(cfg) + "\n".join(levels) + "\n"


def _yaml_recursive_alias(cfg, root):
    return yaml.safe_dump(cfg) + "loop: &loop [1, *loop]\n"


def _config_not_utf8(cfg, root):
    return (yaml.safe_dump(cfg) + "# r\u00e9glages\n").encode("latin-1")


def _config_is_a_list(cfg, root):
    return yaml.safe_dump([cfg])


def _output_scheme_not_installed(cfg, root):
    cfg["output"] = "oci://bucket@namespace/models"  # needs ocifs, which loraship does not install


def _output_scheme_unknown(cfg, root):
    cfg["output"] = "nosuchstore://bucket/models"


def _quantization_llama_cpp_cannot_make(cfg, root):
    cfg["quantization"] = "IQ2_XXS"  # needs an importance matrix; the pinned pipeline ships K-quants and Q8_0


def _workdir_is_a_file(cfg, root):
    cfg["workdir"] = str(write(root / "workdir-file", "x"))


def _row_is_a_list(cfg, root):
    cfg["datasets"][0]["path"] = str(write(root / "list.jsonl", json.dumps([{"role": "user"}]) + "\n"))


def _chat_content_not_text(cfg, root):
    row = {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "yo"}]}
    cfg["datasets"][0]["path"] = str(write(root / "number.jsonl", json.dumps(row) + "\n"))


def _val_set_everything(cfg, root):
    cfg["val_set_size"] = 1.0


def _secret_env_name(cfg, root):
    cfg["env_from_secrets"] = {"hf-token": "hf-token"}


def _no_target_modules(cfg, root):
    cfg["lora_target_modules"] = []


def _golden_file_missing(cfg, root):
    cfg["golden_prompts"] = str(root / "no-golden.jsonl")


def _relative_dataset_missing(cfg, root):
    cfg["datasets"][0]["path"] = "data/nope.jsonl"  # resolved beside the config file, and named so


def model_file(name: str, value):
    """A breaker writing `value` as the model folder's `name` (valid JSON, wrong shape)."""

    def breaker(cfg, root):
        (Path(cfg["base_model"]) / name).write_text(json.dumps(value))

    return breaker


def model_file_key(name: str, **changes):
    """A breaker changing keys of the model folder's `name` (None removes a key); the file is created if absent."""

    def breaker(cfg, root):
        path = Path(cfg["base_model"]) / name
        data = json.loads(path.read_text()) if path.is_file() else {}
        data.update(changes)
        path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))

    return breaker


def _dataset_url(url: str):
    def breaker(cfg, root):
        cfg["datasets"][0]["path"] = url

    return breaker


def _golden_prompts_url(cfg, root):
    cfg["golden_prompts"] = "file://" + str(good_dataset(root))


REPLACE = "replace it with the file from the original checkpoint (its Hugging Face repository)"


def _embedding_only_as_lm_head(tied: bool, adapter_gguf: bool):
    """Weights with lm_head.weight and no model.embed_tokens.weight (issue 22)."""

    def breaker(cfg, root):
        import numpy as np
        from safetensors.numpy import save_file

        folder = Path(cfg["base_model"])
        save_file({"lm_head.weight": np.zeros((4, 2), dtype=np.float32)}, str(folder / "model.safetensors"))
        model_file_key("config.json", tie_word_embeddings=tied or None)(cfg, root)
        cfg["adapter_gguf"] = adapter_gguf

    return breaker


def crafted_safetensors(path: Path, offsets: dict[str, list[int]], data_bytes: int) -> None:
    """A safetensors file whose header says what we write (F32 tensors of 4 values), data as given."""
    header = json.dumps({name: {"dtype": "F32", "shape": [2, 2], "data_offsets": o} for name, o in offsets.items()})
    header += " " * (-len(header) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * data_bytes)


def _link_outside_model_folder(cfg, root):
    secret = write(root / "credentials", "[default]\naws_secret_access_key = planted\n")
    os.symlink(secret, Path(cfg["base_model"]) / "notes.txt")


def _safetensors_overlapping_offsets(cfg, root):
    crafted_safetensors(Path(cfg["base_model"]) / "model.safetensors", {"a": [0, 16], "b": [8, 24]}, 24)


def _safetensors_offsets_past_the_data(cfg, root):
    crafted_safetensors(Path(cfg["base_model"]) / "model.safetensors", {"a": [0, 16], "b": [16, 4096]}, 32)


def _safetensors_offsets_reversed(cfg, root):
    crafted_safetensors(Path(cfg["base_model"]) / "model.safetensors", {"a": [0, 16], "b": [32, 16]}, 32)


def _hf_output_without_token(cfg, root):
    cfg["output"] = "hf://alice/tiny-model"


# Environment of the run (a breaker's `env`): no HF_TOKEN and no stored `hf auth login` token.
_hf_output_without_token.env = {"HF_TOKEN": "", "HF_TOKEN_PATH": "no-stored-token"}


def _hf_output_offline(cfg, root):
    cfg["output"] = "hf://alice/tiny-model"


_hf_output_offline.env = {"HF_TOKEN": "hf_not_a_real_token", "HF_HUB_OFFLINE": "1"}


def _hf_output_a_space(cfg, root):
    cfg["output"] = "hf://spaces/alice/demo"


def _sharded(cfg, root) -> Path:
    """The fake model's weights as the first of two shards, with the index transformers reads."""
    folder = Path(cfg["base_model"])
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 16},
        "weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"},
    }
    return write(folder / "model.safetensors.index.json", json.dumps(index))


def _shard_missing(cfg, root):
    _sharded(cfg, root)  # the index names model-00002-of-00002.safetensors, which is not there


def _shard_index_cut_short(cfg, root):
    index = _sharded(cfg, root)
    write(index, index.read_text()[:50])


def sentencepiece_model() -> bytes:
    """A small real sentencepiece model, trained in memory (a fraction of a second)."""
    import sentencepiece as spm

    text = ["the quick brown fox jumps over the lazy dog", "a tiny sentencepiece model for the checks"] * 40
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=60, minloglevel=2, hard_vocab_limit=False
    )
    return model.getvalue()


def _sentencepiece_cut_short(cfg, root):
    data = sentencepiece_model()
    write(Path(cfg["base_model"]) / "tokenizer.model", data[: len(data) // 2])


def tiny_model_copy(cfg, root, **config_changes) -> Path:
    """The tiny Llama (a real sentencepiece tokenizer and template) copied beside the config, config.json changed."""
    import shutil

    from loraship.fixtures.tinymodel import ensure_tiny_model
    from tests.conftest import cache_lock

    folder = root / "tiny"
    with cache_lock(REPO / ".loraship" / "models" / "tiny-llama") as cached:
        shutil.copytree(ensure_tiny_model(cached), folder)
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, **config_changes}))
    cfg.update(base_model=str(folder), imatrix=False, sequence_len=256)  # its max_position_embeddings is 512
    return folder


def _tokenizer_beyond_vocab(cfg, root):
    tiny_model_copy(cfg, root, vocab_size=300)  # its tokenizer has 512 tokens


def _auto_fits_no_rung(cfg, root):
    tiny_model_copy(cfg, root)
    cfg.update(quantization="auto", target_gpu_memory_gib=0.5)  # llama.cpp's CUDA context alone takes 0.69 GiB


def _sequence_beyond_positions(cfg, root):
    model_file_key("config.json", max_position_embeddings=256)(cfg, root)
    cfg["sequence_len"] = 1024


def _golden_prompt_beyond_context(cfg, root):
    tiny_model_copy(cfg, root)
    rows = [{"prompt": "hello"}, {"prompt": " ".join(["zorvia kelmar"] * 200)}]
    cfg["golden_prompts"] = str(write(root / "golden.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))
    cfg["target_context"] = 256


CASES = [
    ("values out of range", _out_of_range, "lora_r: Input should be greater than or equal to 1"),
    ("model folder without config.json", _no_config_json, "no config.json"),
    (
        "architecture the converter cannot handle",
        _unsupported_architecture,
        "FrobnicatorForCausalLM is not supported by llama.cpp's converter",
    ),
    # a pre-tokenizer llama.cpp does not recognise: tests/test_plan_messages.py, on Qwen's real tokenizer
    ("chat row without assistant turn", _chat_without_assistant, "no assistant message"),
    ("chat message with unknown role", _chat_bad_role, "messages[0] must be"),
    ("model needing remote code", _remote_code, "set trust_remote_code: true"),
    ("warmup longer than training", _warmup_too_long, "warmup_steps (10) must be smaller than max_steps (5)"),
    ("golden prompt with a bad regex", _bad_golden_regex, "expect_regex is not a valid regular expression"),
    ("run name escaping the artifact root", _run_name_escape, "run_name: String should match pattern"),
    ("negative learning rate", _negative_learning_rate, "learning_rate: Input should be greater than 0"),
    ("missing base model folder", _missing_base, "folder does not exist"),
    ("missing dataset file", _missing_dataset, "file not found"),
    ("malformed JSONL line", _malformed_line, "line 3: malformed JSON"),
    ("empty dataset", _empty_dataset, "empty (no rows)"),
    ("unknown dataset type", _unknown_type, "'oasst' is not allowed"),
    ("unknown quantization", _unknown_quant, "'Q3_K_XL' is not allowed"),
    ("unwritable output", _unwritable_output, "cannot write there"),
    ("non-UTF-8 dataset", _non_utf8, "not UTF-8"),
    ("alpaca row missing output", _missing_fields, "alpaca rows need instruction/output"),
    ("model folder without tokenizer", _no_tokenizer, "no tokenizer"),
    ("pickle-only checkpoint", _pickle_only, "only pickle checkpoints"),
    ("unknown config key", _unknown_key, "did you mean 'lora_r'"),
    # issue 12's additions
    ("chat row ending with a user turn", _chat_ends_with_user, "must end with the assistant's answer"),
    ("role the template does not know", _chat_role_unknown_to_template, "messages[1] must be"),
    ("duplicate key in the YAML", _duplicate_yaml_key, "key 'lora_r' appears twice"),
    ("YAML alias bomb", _yaml_alias_bomb, "alias bomb"),
    ("recursive YAML alias", _yaml_recursive_alias, "recursive YAML alias"),
    ("config file not UTF-8", _config_not_utf8, "not UTF-8 text"),
    ("config that is a list", _config_is_a_list, "expected a mapping of config keys"),
    (
        "output URL whose fsspec implementation is missing",
        _output_scheme_not_installed,
        "no filesystem for this URL is installed",
    ),
    ("output URL scheme nobody knows", _output_scheme_unknown, "Protocol not known: nosuchstore"),
    (
        "quantization the pinned llama.cpp cannot produce",
        _quantization_llama_cpp_cannot_make,
        "'IQ2_XXS' is not allowed",
    ),
    ("workdir that is a file", _workdir_is_a_file, "cannot create it"),
    ("dataset row that is a list", _row_is_a_list, "expected a JSON object, got list"),
    ("chat content that is not text", _chat_content_not_text, "messages[0] must be"),
    ("validation split of everything", _val_set_everything, "val_set_size: Input should be less than 1"),
    ("secret mapped to a bad variable name", _secret_env_name, "are not environment variable names"),
    ("no LoRA target modules", _no_target_modules, "list is empty"),
    ("golden prompts file missing", _golden_file_missing, "no-golden.jsonl: file not found"),
    ("relative dataset path missing", _relative_dataset_missing, "data/nope.jsonl: file not found"),
    (
        "symlink in the model folder pointing outside it",
        _link_outside_model_folder,
        "1 symlink(s) lead outside the folder (notes.txt ->",
    ),
    (
        "safetensors header with overlapping offsets",
        _safetensors_overlapping_offsets,
        "tensors 'a' [0, 16) and 'b' [8, 24) overlap",
    ),
    (
        "safetensors header with offsets past the data",
        _safetensors_offsets_past_the_data,
        "tensor 'b' has data_offsets [16, 4096] past the end of the data (32 bytes",
    ),
    (
        "safetensors header with offsets ending before they begin",
        _safetensors_offsets_reversed,
        "tensor 'b' has data_offsets [32, 16], which end before they begin",
    ),
    # issue 11: publish to the Hugging Face Hub (a token that cannot write: tests/test_publish_hub.py)
    (
        "hf:// output without a token",
        _hf_output_without_token,
        "no Hugging Face token to publish with; set HF_TOKEN to a token with write access",
    ),
    ("hf:// output while the Hub is switched off", _hf_output_offline, "HF_HUB_OFFLINE is set"),
    ("hf:// output naming a Space", _hf_output_a_space, "a space repository holds an app or code"),
    # issue 25: model files that are valid JSON of the wrong shape
    (
        "config.json that is a list",
        model_file("config.json", [{"model_type": "llama"}]),
        f"config.json holds a list, not a JSON object of settings; {REPLACE}",
    ),
    (
        "config.json that is a string",
        model_file("config.json", "llama"),
        f"config.json holds a string, not a JSON object of settings; {REPLACE}",
    ),
    (
        "config.json that is a number",
        model_file("config.json", 7),
        f"config.json holds the number 7, not a JSON object of settings; {REPLACE}",
    ),
    (
        "config.json without model_type",
        model_file_key("config.json", model_type=None),
        "config.json: 'model_type' is missing or not a name",
    ),
    (
        "config.json whose architectures is a string",
        model_file_key("config.json", architectures="LlamaForCausalLM"),
        "config.json: 'architectures' is \"LlamaForCausalLM\", not a list of model class names",
    ),
    (
        "config.json whose hidden_size is text",
        model_file_key("config.json", hidden_size="4096"),
        f"config.json: 'hidden_size' is \"4096\", not a positive whole number; {REPLACE}",
    ),
    (
        "tokenizer_config.json that is a list",
        model_file("tokenizer_config.json", []),
        f"tokenizer_config.json holds a list, not a JSON object of settings; {REPLACE}",
    ),
    (
        "tokenizer_config.json that is a string",
        model_file("tokenizer_config.json", "PreTrainedTokenizerFast"),
        "tokenizer_config.json holds a string, not a JSON object of settings",
    ),
    (
        "tokenizer_config.json that is a number",
        model_file("tokenizer_config.json", 1),
        "tokenizer_config.json holds the number 1, not a JSON object of settings",
    ),
    (
        "tokenizer_config.json whose chat_template is a number",
        model_file_key("tokenizer_config.json", chat_template=3),
        "tokenizer_config.json: 'chat_template' is the number 3, not a Jinja template string",
    ),
    (
        "tokenizer_config.json whose eos_token is a list",
        model_file_key("tokenizer_config.json", eos_token=["</s>"]),
        "tokenizer_config.json: 'eos_token' is a list, not a token string",
    ),
    (
        "generation_config.json that is a list",
        model_file("generation_config.json", [2]),
        f"generation_config.json holds a list, not a JSON object of settings; {REPLACE}",
    ),
    (
        "generation_config.json that is a string",
        model_file("generation_config.json", "greedy"),
        "generation_config.json holds a string, not a JSON object of settings",
    ),
    (
        "generation_config.json that is a number",
        model_file("generation_config.json", 2),
        "generation_config.json holds the number 2, not a JSON object of settings",
    ),
    (
        "generation_config.json whose eos_token_id is text",
        model_file_key("generation_config.json", eos_token_id="</s>"),
        "generation_config.json: 'eos_token_id' is \"</s>\", not a token id or a list of token ids",
    ),
    # issue 25: dataset URLs whose scheme no installed fsspec implementation serves
    (
        "dataset URL whose fsspec implementation is missing",
        _dataset_url("oci://bucket@namespace/train.jsonl"),
        "no installed filesystem serves 'oci://' (Install ocifs to access OCI Object Storage); pip install ocifs",
    ),
    (
        "dataset URL scheme nobody knows",
        _dataset_url("nosuchstore://bucket/train.jsonl"),
        "'nosuchstore://' is a URL scheme no fsspec filesystem knows; use a local path",
    ),
    (
        "parquet dataset URL whose fsspec implementation is missing",
        _dataset_url("oci://bucket@namespace/train.parquet"),
        "no installed filesystem serves 'oci://'",
    ),
    ("golden prompts at a URL", _golden_prompts_url, "must be a local file, not a URL"),
    # issue 22: an embedding stored only as lm_head.weight that the merge cannot mend (it renames a tied one)
    (
        "embedding only as lm_head, untied",
        _embedding_only_as_lm_head(tied=False, adapter_gguf=False),
        "the weights have lm_head.weight but no model.embed_tokens.weight, and config.json does not tie the two",
    ),
    (
        "tied embedding only as lm_head, with adapter_gguf",
        _embedding_only_as_lm_head(tied=True, adapter_gguf=True),
        "llama.cpp's converter would write a GGUF without token_embd.weight that llama.cpp cannot load. Set "
        "adapter_gguf: false",
    ),
    # issue 34: faults that were found at train, after it, or as tracebacks
    (
        "sharded checkpoint whose index names a missing shard",
        _shard_missing,
        "model.safetensors.index.json names model-00002-of-00002.safetensors, which is not in",
    ),
    (
        "sharded checkpoint whose index is cut short",
        _shard_index_cut_short,
        "model.safetensors.index.json is not valid JSON (Unterminated string",
    ),
    ("sentencepiece tokenizer.model cut short", _sentencepiece_cut_short, "tokenizer.model ("),
    (
        "tokenizer larger than the model's vocab_size",
        _tokenizer_beyond_vocab,
        "has a tokenizer of 512 tokens (added tokens included), more than config.json's vocab_size 300",
    ),
    (
        "quantization auto where no rung fits the target GPU",
        _auto_fits_no_rung,
        "target_gpu_memory_gib 0.5: quantization auto fits no rung of its ladder",
    ),
    (
        "sequence_len beyond max_position_embeddings",
        _sequence_beyond_positions,
        "sequence_len 1024: beyond the base model's context, max_position_embeddings 256",
    ),
    ("golden prompt longer than the serving context", _golden_prompt_beyond_context, "prompt 2 ("),
]


def test_yaml_syntax_error(tmp_path):
    config_file = write(tmp_path / "broken.yaml", "base_model: [unclosed\n")
    result = subprocess.run(
        [sys.executable, "-m", "loraship.cli", "run", str(config_file)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_table_has_at_least_forty_cases():
    assert len(CASES) >= 40


def test_workdir_on_a_full_disk(tmp_path):
    """The disk that holds workdir reports no free space (as a full volume does): refused up front."""
    cfg = {
        "run_name": "bad",
        "base_model": str(fake_model(tmp_path)),
        "datasets": [{"path": str(good_dataset(tmp_path)), "type": "chat"}],
        "workdir": str(tmp_path / "work"),
        "output": str(tmp_path / "artifacts"),
    }
    config_file = write(tmp_path / "config.yaml", yaml.safe_dump(cfg))
    full_disk = (
        "import shutil, sys; real = shutil.disk_usage; "
        "shutil.disk_usage = lambda p: real(p)._replace(free=4096); "
        "sys.argv = ['loraship', 'run', sys.argv[1]]; from loraship.cli import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", full_disk, str(config_file)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "its disk is full (0 MiB free" in " ".join(output.split()), output
    assert "Traceback" not in output and not (tmp_path / "work" / "bad" / "plan").exists()


@pytest.mark.parametrize("name,breaker,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_reported_clearly(tmp_path, name, breaker, expected):
    cfg = {
        "run_name": "bad",
        "base_model": str(fake_model(tmp_path)),
        "datasets": [{"path": str(good_dataset(tmp_path)), "type": "chat"}],
        "workdir": str(tmp_path / "work"),
        "output": str(tmp_path / "artifacts"),
    }
    text = breaker(cfg, tmp_path)  # a breaker of the YAML itself returns the file's content
    config_file = write(tmp_path / "config.yaml", text if text is not None else yaml.safe_dump(cfg))
    result = subprocess.run(
        [sys.executable, "-m", "loraship.cli", "run", str(config_file)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, **getattr(breaker, "env", {})},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert expected in " ".join(output.split()), output
    assert "Traceback" not in output, output
    assert not (tmp_path / "work" / "bad" / "train").exists()  # nothing ran


@pytest.mark.parametrize(
    "name,breaker,expected",
    [c for c in CASES if not hasattr(c[1], "env")],
    ids=[c[0] for c in CASES if not hasattr(c[1], "env")],
)
def test_bad_input_stops_loraship_plan_too(tmp_path, name, breaker, expected):
    """`loraship plan` runs the checks `loraship run` runs before training (in this process: the table above runs
    each as a command already; the Hub cases, which set the environment, stay there)."""
    from typer.testing import CliRunner

    from loraship.cli import app

    cfg = {
        "run_name": "bad",
        "base_model": str(fake_model(tmp_path)),
        "datasets": [{"path": str(good_dataset(tmp_path)), "type": "chat"}],
        "workdir": str(tmp_path / "work"),
        "output": str(tmp_path / "artifacts"),
    }
    text = breaker(cfg, tmp_path)
    config_file = write(tmp_path / "config.yaml", text if text is not None else yaml.safe_dump(cfg))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # as the table's commands run: a relative dataset path is named as written
    try:
        result = CliRunner().invoke(app, ["plan", str(config_file)])
    finally:
        os.chdir(cwd)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, (result.output, result.exception)
    assert expected in " ".join(result.output.split()), result.output
    assert "Peak training memory" not in result.output  # stopped before predicting anything


def tiny_gguf(path: Path) -> Path:
    """An F16 GGUF of two 64x64 tensors, written by gguf-py."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(1)  # F16
    for name in ("a", "b"):
        writer.add_tensor(name, np.ones((64, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_cut_short(path):
    path.write_bytes(path.read_bytes()[:-100])


def _gguf_offset_past_the_end(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    reader.tensors[1].field.parts[-1][0] = 1 << 20  # tensor b's data offset, in the header's tensor infos
    reader.data.flush()


def _gguf_tensors_overlap(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    reader.tensors[1].field.parts[-1][0] = 32  # tensor b now starts inside tensor a
    reader.data.flush()


@pytest.mark.parametrize(
    "breaker,expected",
    [
        (
            _gguf_cut_short,
            "tensor 'b' declares 8192 bytes at offset 8384, up to byte 16576, but the file has 16476 bytes: "
            "its tensor data runs past the end of the file",
        ),
        (_gguf_offset_past_the_end, "tensor 'b' declares 8192 bytes at offset 1048768"),
        (_gguf_tensors_overlap, "tensors 'a' (bytes 192-8384) and 'b' (bytes 224-8416) overlap"),
    ],
    ids=["truncated", "offset past the end", "overlapping tensors"],
)
def test_gguf_whose_tensor_data_lies_is_refused_before_quantizing(tmp_path, breaker, expected):
    """The convert stage's GGUF matches its manifest but its header lies: quantize names it and does nothing."""
    from loraship.constants import F16_GGUF
    from loraship.runtime.manifest import write_manifest

    cfg = {
        "run_name": "bad",
        "base_model": str(fake_model(tmp_path)),
        "datasets": [{"path": str(good_dataset(tmp_path)), "type": "chat"}],
        "workdir": str(tmp_path / "work"),
        "output": str(tmp_path / "artifacts"),
    }
    convert = tmp_path / "work" / "bad" / "convert"
    convert.mkdir(parents=True)
    gguf = tiny_gguf(convert / F16_GGUF)
    breaker(gguf)
    before = gguf.read_bytes()
    write_manifest(
        convert, stage="convert", run_name="bad", fingerprint="test", config={}, upstream={}, metrics={}, started=0.0
    )
    config_file = write(tmp_path / "config.yaml", yaml.safe_dump(cfg))
    result = subprocess.run(
        [sys.executable, "-m", "loraship.stages.quantize", str(config_file)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"{gguf}: {expected}" in " ".join(output.split()), output
    assert "Traceback" not in output, output
    assert gguf.read_bytes() == before  # nothing lost
    assert not list((tmp_path / "work" / "bad" / "quantize").glob("*.gguf"))  # nothing quantized


def fake_sdist(folder: Path, version: str, marker: Path | None = None) -> Path:
    """llama_cpp_python-<version>.tar.gz holding a vendor/llama.cpp converter and an in-tree build backend
    with no requirements, so that pip can prepare its metadata without an index; the backend creates
    `marker` when pip runs it."""
    backend = (f"open({str(marker)!r}, 'w').close()\n" if marker else "") + (
        "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        "def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):\n"
        "    import os\n"
        f"    d = os.path.join(metadata_directory, 'llama_cpp_python-{version}.dist-info')\n"
        "    os.makedirs(d)\n"
        "    open(os.path.join(d, 'METADATA'), 'w')"
        f".write('Metadata-Version: 2.1\\nName: llama_cpp_python\\nVersion: {version}\\n')\n"
        "    return os.path.basename(d)\n"
    )
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": backend,
        "PKG-INFO": f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n",
        "vendor/llama.cpp/convert_hf_to_gguf.py": "# converter\n",
        "vendor/llama.cpp/conversion/__init__.py": "",
        "vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
        "vendor/llama.cpp/src/llama.cpp": "// not unpacked\n",
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_cpp_python-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"llama_cpp_python-{version}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only tmp_path/links: no network, no index, no pip configuration of this machine."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_converter_sdist_with_another_sha256_is_refused(tmp_path, local_index):
    """A tampered sdist under the pinned name: IntegrityError naming it and its digest; nothing of it unpacked
    or run, and the converter already in the cache stays as it was."""
    from loraship.constants import LLAMA_CPP_PYTHON_VERSION
    from loraship.errors import IntegrityError
    from loraship.llamacpp.llamacpp import SDIST_SHA256, fetch_converter

    ran = tmp_path / "backend-ran"
    tampered = fake_sdist(local_index, LLAMA_CPP_PYTHON_VERSION, marker=ran)
    digest = hashlib.sha256(tampered.read_bytes()).hexdigest()
    cached = tmp_path / "cache" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    (cached / "conversion").mkdir(parents=True)
    (cached / "convert_hf_to_gguf.py").write_text("# the converter fetched earlier\n")
    with pytest.raises(IntegrityError) as caught:
        fetch_converter(cached)
    message = str(caught.value)
    assert f"{tampered.name}: sha256 {digest} is not {SDIST_SHA256[LLAMA_CPP_PYTHON_VERSION]}" in message
    assert "run `loraship fetch-converter` again" in message
    assert not ran.exists()  # pip checked the digest before running anything from the archive
    assert (cached / "convert_hf_to_gguf.py").read_text() == "# the converter fetched earlier\n"
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no staging folder left


def test_converter_sdist_with_the_pinned_sha256_is_unpacked(tmp_path, local_index, monkeypatch):
    """The same path with the digest pinned for the file: pip runs its backend (so the refusal above stopped
    it), and only the converter's folders are unpacked."""
    from loraship.llamacpp import llamacpp
    from loraship.constants import LLAMA_CPP_PYTHON_VERSION

    ran = tmp_path / "backend-ran"
    sdist = fake_sdist(local_index, LLAMA_CPP_PYTHON_VERSION, marker=ran)
    monkeypatch.setitem(
        llamacpp.SDIST_SHA256, LLAMA_CPP_PYTHON_VERSION, hashlib.sha256(sdist.read_bytes()).hexdigest()
    )
    folder = llamacpp.fetch_converter(tmp_path / "cache" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}")
    assert sorted(p.name for p in folder.iterdir()) == ["conversion", "convert_hf_to_gguf.py", "gguf-py"]
    assert ran.exists()


def test_links_of_a_hub_cache_snapshot_are_accepted_and_others_named(tmp_path):
    """huggingface_hub's cache links snapshots/<rev>/<file> to ../../blobs/<hash>: that stays inside
    the repository's cache folder; a link from the same snapshot to a file beside the cache does not."""
    from loraship.planning.preflight import outside_link_problems

    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    write(repo / "blobs" / "5f1e", "{}")
    os.symlink("../../blobs/5f1e", snapshot / "config.json")
    assert outside_link_problems(snapshot) == []
    os.symlink(write(tmp_path / "hub" / "credentials", "planted"), snapshot / "tokenizer.model")
    [problem] = outside_link_problems(snapshot)
    assert f"tokenizer.model -> {tmp_path / 'hub' / 'credentials'}" in problem


@pytest.mark.parametrize(
    "content,expected",
    [
        ("[8, 16]", "adapter_config.json holds a list, not a JSON object of settings"),
        ('"lora"', "adapter_config.json holds a string, not a JSON object of settings"),
        ("16", "adapter_config.json holds the number 16, not a JSON object of settings"),
        ('{"lora_alpha": 16}', "adapter_config.json: 'r' is null, not a positive whole number (the LoRA rank)"),
        ('{"r": 8, "lora_alpha": "16"}', "adapter_config.json: 'lora_alpha' is \"16\", not a number"),
        (None, "adapter_config.json: not found"),
    ],
    ids=["a list", "a string", "a number", "without r", "lora_alpha as text", "missing"],
)
def test_adapter_config_of_the_wrong_shape_is_named_before_merging(tmp_path, content, expected):
    """merge reads the train stage's adapter_config.json (PEFT's own): each wrong shape is one message naming the
    file, what is wrong and the fix, not a KeyError or TypeError from inside the merge."""
    import importlib

    from loraship.errors import IntegrityError

    merge = importlib.import_module("loraship.stages.merge")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    if content is not None:
        write(adapter / "adapter_config.json", content)
    with pytest.raises(IntegrityError) as caught:
        merge.lora_deltas(adapter)
    message = str(caught.value)
    assert expected in message and str(adapter) in message, message
    assert "run the train stage again (loraship run CONFIG --from train)" in message


@pytest.mark.parametrize(
    "content,expected",
    [
        ('["llama"]', "config.json holds a list, not a JSON object of settings"),
        (
            '{"model_type": "llama", "hidden_size": [4096]}',
            "config.json: 'hidden_size' is [4096], not a positive whole number",
        ),
    ],
    ids=["a list", "a size that is a list"],
)
def test_the_planner_reads_config_json_only_once_it_is_an_object_of_the_right_shape(tmp_path, content, expected):
    from loraship.errors import ConfigError
    from loraship.models import read_model_config

    write(tmp_path / "config.json", content)
    with pytest.raises(ConfigError) as caught:
        read_model_config(tmp_path)
    assert expected in str(caught.value) and "replace it with the file from the original checkpoint" in str(
        caught.value
    )
