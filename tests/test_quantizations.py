"""Several quantizations in one run (`quantization: [Q4_K_M, Q8_0]`), on the tiny model's pipeline run."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from loraship.config import parse_config
from loraship.constants import (
    GGUF_FILE_TYPES,
    LADDER_PLOT_FILE,
    MANIFEST_NAME,
    MODEL_CARD,
    MODELFILE,
    STAGES,
    VERIFY_FILE,
    quantized_gguf_name,
)
from loraship.llamacpp.gguf_info import read_gguf
from loraship.llamacpp.gguf_tools import gguf_file
from loraship.runtime.manifest import sha256_file
from loraship.runtime.stage import stage_dir


def run_all(config) -> dict:
    return {stage: importlib.import_module(f"loraship.stages.{stage}").run(config) for stage in STAGES}


def test_two_quantizations_are_made_verified_and_shipped(pipeline_run):
    config, first = pipeline_run
    assert config.quantizations == ["Q4_K_M"]
    both = parse_config({**config.model_dump(mode="json"), "quantization": ["Q4_K_M", "Q8_0"]})
    try:
        again = run_all(both)
        ran = {stage for stage, m in again.items() if not m.get("_skipped")}
        assert ran == {"plan", "quantize", "verify", "publish"}  # training, merge, convert untouched

        # The Q4_K_M GGUF the fixture made is kept, not made again; Q8_0 is new.
        made = again["quantize"]["metrics"]["quantizations"]
        assert made["Q4_K_M"]["reused"] and not made["Q8_0"]["reused"]
        q4 = quantized_gguf_name("Q4_K_M")
        assert again["quantize"]["outputs"][q4] == first["quantize"]["outputs"][q4]
        for q in both.quantizations:
            gguf = stage_dir(both, "quantize") / quantized_gguf_name(q)
            assert read_gguf(gguf)["fields"]["general.file_type"] == GGUF_FILE_TYPES[q]

        verify = json.loads((stage_dir(both, "verify") / VERIFY_FILE).read_text(encoding="utf-8"))
        assert verify["passed"] and set(verify["quantizations"]) == {"Q4_K_M", "Q8_0"}
        assert (
            verify["quantization"] == "Q4_K_M"
            and verify["gates"]["perplexity_ratio"] == verify["quantizations"]["Q4_K_M"]["gates"]["perplexity_ratio"]
        )  # the primary's gates keep their names
        assert verify["gates"]["Q8_0/same_top_token"]["evidence"] >= both.min_scored_tokens
        assert verify["quantizations"]["Q8_0"]["gates"]["file_type"]["value"] == GGUF_FILE_TYPES["Q8_0"]

        root = Path(both.output) / both.run_name
        published = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
        assert published["gguf"] == q4 and list(published["quantizations"]) == ["Q4_K_M", "Q8_0"]
        for q, shipped in published["quantizations"].items():
            assert (
                sha256_file(root / shipped["gguf"])
                == shipped["sha256"]
                == published["files"][shipped["gguf"]]["sha256"]
            )
            assert shipped["verify"]["passed"] and shipped["verify"]["kl_mean"] is not None
        assert (root / MODELFILE).read_text(encoding="utf-8").startswith(f"FROM ./{q4}\n")  # the primary
        card = (root / MODEL_CARD).read_text(encoding="utf-8")
        assert f"| Q4_K_M (primary) | `{q4}` |" in card and f"| Q8_0 | `{quantized_gguf_name('Q8_0')}` |" in card
        assert f"llama-server -m {q4} --jinja" in card
        # Several quantizations: verify drew the ladder, publish ships it and the card shows it.
        assert (stage_dir(both, "verify") / LADDER_PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (root / LADDER_PLOT_FILE).is_file() and f"]({LADDER_PLOT_FILE})" in card
        assert gguf_file(root).name == q4  # what `loraship chat ARTIFACT` opens
    finally:
        # Back to the fixture's one quantization: its GGUF is kept again, and Q8_0 leaves the artifact.
        back = run_all(config)
        assert back["quantize"]["metrics"]["quantizations"]["Q4_K_M"]["reused"]
        assert not (Path(config.output) / config.run_name / quantized_gguf_name("Q8_0")).exists()


def test_a_failing_quantization_is_named(pipeline_run, monkeypatch):
    """verify fails when any quantization fails, and says which."""
    import pytest

    from loraship.errors import LorashipError

    config, _ = pipeline_run
    strict = parse_config({**config.model_dump(mode="json"), "quantization": ["Q8_0", "Q4_K_M"], "kl_mean_max": 1e-9})
    try:
        for stage in ("plan", "quantize"):
            importlib.import_module(f"loraship.stages.{stage}").run(strict)
        with pytest.raises(LorashipError, match=r"verify failed for Q8_0, Q4_K_M: .*Q4_K_M/kl_divergence_mean"):
            importlib.import_module("loraship.stages.verify").run(strict)
    finally:
        run_all(config)


def test_auto_ships_the_smallest_rung_that_passes_every_gate(pipeline_run):
    """quantization: auto quantizes the ladder, verifies it smallest first, stops at the first rung that
    passes every gate under its own limits, and ships that GGUF alone, the ladder in verify.json and the card."""
    from loraship.constants import AUTO_LADDER

    config, _ = pipeline_run
    auto = parse_config({**config.model_dump(mode="json"), "quantization": "auto"})
    assert auto.auto_quantization and auto.quantizations == list(AUTO_LADDER)
    try:
        run_all(auto)
        verify = json.loads((stage_dir(auto, "verify") / VERIFY_FILE).read_text(encoding="utf-8"))
        chosen = verify["shipped_quantization"]
        assert verify["passed"] and verify["quantization"] == chosen
        rows = {r["quant"]: r for r in verify["ladder"]}
        assert list(rows) == list(AUTO_LADDER)
        smaller = list(AUTO_LADDER)[: list(AUTO_LADDER).index(chosen)]
        # Every smaller rung was verified and failed (never shipped), the chosen one passed, larger ones were not
        # tried.
        assert all(rows[q]["tried"] and not rows[q]["passed"] and rows[q]["failed_gates"] for q in smaller)
        assert rows[chosen]["passed"] and rows[chosen]["bytes"] == verify["gguf_bytes"]
        assert not any(r["tried"] for r in verify["ladder"][len(smaller) + 1 :])
        limits = verify["gate_limits"]
        assert limits == auto.gate_limits(chosen)  # judged by its own quantization's limits
        assert verify["gates"]["kl_divergence_mean"]["threshold"] == limits["kl_mean_max"]

        root = Path(auto.output) / auto.run_name
        published = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
        assert published["quantization"] == chosen and list(published["quantizations"]) == [chosen]
        assert sorted(p.name for p in root.glob("model-*.gguf")) == [quantized_gguf_name(chosen)]
        assert (root / MODELFILE).read_text(encoding="utf-8").startswith(f"FROM ./{quantized_gguf_name(chosen)}\n")
        card = (root / MODEL_CARD).read_text(encoding="utf-8")
        assert "`quantization: auto` verified the ladder" in card and f"| {chosen} |" in card and "| shipped |" in card
        assert (root / LADDER_PLOT_FILE).is_file() and f"]({LADDER_PLOT_FILE})" in card
    finally:
        run_all(config)


def test_auto_where_no_rung_passes_names_the_largest_that_fits_and_why(pipeline_run, monkeypatch):
    import pytest

    from loraship.errors import LorashipError
    from loraship.stages import verify as verify_stage

    config, _ = pipeline_run
    auto = parse_config({**config.model_dump(mode="json"), "quantization": "auto"})

    def section(q, fits, kl):
        gates = {
            "fits_target_gpu": {"passed": fits, "value": 1, "threshold": 1},
            "kl_divergence_mean": {"passed": False, "value": kl, "threshold": 0.1},
        }
        return {"passed": False, "gates": gates, "gguf_bytes": 1, "eval_agreement": {"kl_mean": kl}}

    fits = {
        "IQ3_M": True,
        "Q3_K_M": True,
        "IQ4_XS": True,
        "Q4_K_M": True,
        "Q5_K_M": False,
        "Q6_K": False,
        "Q8_0": False,
    }
    monkeypatch.setattr(
        verify_stage,
        "verify_quantization",
        lambda ctx, cfg, q, reference, device, with_adapter: section(q, fits[q], 0.5),
    )

    class Ctx:
        dir = Path("/nonexistent")
        started = 0.0

    monkeypatch.setattr(verify_stage, "atomic_write_json", lambda path, data: None)
    with pytest.raises(
        LorashipError,
        match=r"no rung passed every gate; the largest that fits the target, Q4_K_M, "
        r"failed kl_divergence_mean \(value 0.5, threshold 0.1\)",
    ):
        verify_stage.run_ladder(Ctx(), auto, {}, "cpu")
    fits.update(IQ3_M=False, Q3_K_M=False, IQ4_XS=False, Q4_K_M=False)
    with pytest.raises(LorashipError, match=r"no rung of IQ3_M, .*Q8_0 fits target_gpu_memory_gib"):
        verify_stage.run_ladder(Ctx(), auto, {}, "cpu")


def test_auto_stands_alone_and_refuses_an_adapter_gguf():
    import pytest

    from loraship.errors import ConfigError
    from tests.test_config import BASE

    with pytest.raises(ConfigError, match="'auto' picks one quantization from its own ladder"):
        parse_config({**BASE, "quantization": ["auto", "Q8_0"]})
    with pytest.raises(ConfigError, match="adapter_gguf quantizes the adapter's base like the shipped GGUF"):
        parse_config({**BASE, "quantization": "auto", "adapter_gguf": True})
