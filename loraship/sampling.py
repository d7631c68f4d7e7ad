"""The decoding an artifact is verified with and shipped with: greedy, every sampler and penalty off.

verify compares llama.cpp's argmax answers with the merged model's greedy ones; a runtime that adds a
penalty serves other answers. llama-cpp-python's server applies repeat_penalty 1.1 to a request that
does not set it (llama_cpp/server/types.py), and so does Ollama (its default options), which the
`openai` client never sends: an answer that must repeat words of the question (a JSON field echoing
the country asked about) then names another. So the one record below is what the served check sends
and what the Modelfile, the card's llama-server command and generation_config.json carry.

Under temperature 0 llama.cpp (llama-cpp-python and llama-server) and Ollama pick the argmax after the
penalties and never reach top_k/top_p/min_p; those are written out at their off values anyway, so a
reader sees every knob, and each value below is the one each runtime documents as off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from loraship.errors import LorashipError

# HF generation_config keys that make model.generate(do_sample=False) something other than argmax
# decoding (sampling-only knobs warn under do_sample false; the others change the greedy pick).
HF_NOT_GREEDY_KEYS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "num_beams",
    "num_beam_groups",
    "penalty_alpha",
    "diversity_penalty",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "guidance_scale",
    "dola_layers",
)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings in llama.cpp's names. The defaults are greedy with nothing else applied."""

    temperature: float = 0.0  # 0: the argmax (llama.cpp, Ollama); no sampling
    top_k: int = 0  # 0: off (llama.cpp: the whole vocabulary; Ollama: no cut)
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off (llama-cpp-python's server and Ollama default to 1.1)
    presence_penalty: float = 0.0  # 0.0: off
    frequency_penalty: float = 0.0  # 0.0: off

    @classmethod
    def from_record(cls, record: dict) -> "Sampling":
        """The record verify.json keeps, read back; refused with the key at fault."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise LorashipError(
                f"sampling settings {unknown} are unknown (known: {sorted(known)}); the verify.json "
                "was written by another loraship: run the verify stage again"
            )
        try:
            return cls(**{k: type(getattr(cls(), k))(v) for k, v in record.items()})
        except (TypeError, ValueError) as e:
            raise LorashipError(f"sampling settings {record} are not numbers; run the verify stage again") from e

    def record(self) -> dict:
        return asdict(self)

    @property
    def greedy(self) -> bool:
        return self == Sampling()

    def openai_request(self) -> dict:
        """Keyword arguments for the `openai` client's chat.completions.create: the OpenAI fields as
        themselves, llama.cpp's own (top_k, min_p, repeat_penalty) in extra_body, which the client
        merges into the JSON body and llama-cpp-python's server and llama-server read."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "extra_body": {"top_k": self.top_k, "min_p": self.min_p, "repeat_penalty": self.repeat_penalty},
        }

    def llama_server_flags(self) -> str:
        """llama-server's flags for the same settings (each one's help text in llama.cpp's common/arg.cpp
        names its off value): they become the defaults of every request that does not set its own."""
        return (
            f"--temp {self.temperature:g} --top-k {self.top_k} --top-p {self.top_p:g} --min-p {self.min_p:g} "
            f"--repeat-penalty {self.repeat_penalty:g} --presence-penalty {self.presence_penalty:g} "
            f"--frequency-penalty {self.frequency_penalty:g}"
        )

    def ollama_parameters(self) -> list[tuple[str, str]]:
        """Modelfile PARAMETER names and values (Ollama's option names are llama.cpp's)."""
        return [(name, f"{value:g}") for name, value in asdict(self).items()]

    def generation_config(self, gen: dict) -> tuple[dict, dict]:
        """generation_config.json for transformers that decodes as this does: (the new settings, the
        settings it dropped or changed with their old values). Only greedy has an HF form here: HF's
        repetition_penalty is not llama.cpp's (it penalises every earlier token, prompt included, with no
        last-n window), so other settings are refused rather than written as something else."""
        if not self.greedy:
            raise LorashipError(
                f"only greedy decoding is written to generation_config.json, not {self.record()}; "
                "ship the default sampling settings"
            )
        out = {k: v for k, v in gen.items() if k not in HF_NOT_GREEDY_KEYS}
        out.update(do_sample=False, repetition_penalty=1.0)
        changed = {
            k: gen[k]
            for k in (*HF_NOT_GREEDY_KEYS, "do_sample", "repetition_penalty")
            if k in gen and gen[k] != out.get(k)
        }
        return out, changed


GREEDY = Sampling()
