"""The train stage's strategies on a real GPU, through `plan` + `train` as shipped (issue #10).

Deselected by default (marker `gpu`) and skipped without CUDA. On the GPU machine, after
`bash .whl-train/install.sh` (bitsandbytes, liger-kernel, pytest, ... into /tmp/site):

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -m gpu tests/test_gpu_smoke.py

Model: Qwen2-0.5B's widths (hidden 896, intermediate 4864, 14 heads, 2 KV heads, vocab 151,936, tied
embeddings) in 6 layers, random bf16 weights built on the GPU, as LlamaForCausalLM with q/k/v biases
(what Qwen2 computes; the tiny model's sentencepiece tokenizer then passes the plan's GGUF check, as in
bench/train_bench.py). Each test forces one strategy, trains a few steps under a capped allocator and
checks: the stage trained (finite losses, the last below the first), the manifest names the forced
strategy with no out-of-memory retry, the measured peak reserved stays within the plan's prediction
plus a margin and under the cap.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from loraship.config import parse_config

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]

GIB = 2**30
CAP_GIB = 32.0
DIMS = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=6,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    attention_bias=True,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
SEQ = 512
SENTENCE = "The capital of Ganraka is Milo, and its river runs north to the sea. "


def prediction_margin_gib(predicted_gib: float) -> float:
    """How far above the plan's predicted reserved a measurement may land: the planner's own safety
    margin at these sizes (0.5 GiB), or 10% of the prediction where that is more."""
    return max(0.5, 0.10 * predicted_gib)


@pytest.fixture(scope="module")
def gpu_model(tiny_model, tmp_path_factory) -> Path:
    # What the train stage sets itself, set here because building the model starts CUDA first.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_bench import make_model

    torch.manual_seed(0)
    out = make_model(DIMS, tiny_model, tmp_path_factory.mktemp("gpu") / "qwen2-0.5b-widths", "cuda")
    torch.cuda.empty_cache()
    return out


def write_data(folder: Path, kind: str, rows: int = 48) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}.jsonl"
    lines = []
    for i in range(rows):
        if kind == "completion":  # past sequence_len: every row truncated to it
            lines.append({"text": SENTENCE * 60})
        else:  # chat rows of varied length, so packing has something to pack
            n = 2 + (i * 7) % 24
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": SENTENCE * max(1, n // 4)},
                        {"role": "assistant", "content": SENTENCE * n},
                    ]
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def config_dict(model_dir: Path, root: Path, name: str, kind: str = "completion", **overrides) -> dict:
    return {
        "run_name": name,
        "base_model": str(model_dir),
        "workdir": str(root / "work"),
        "output": str(root / "out"),
        "datasets": [{"path": str(write_data(root / "data", kind)), "type": kind}],
        "val_set_size": 0.1,
        "adapter": "lora",
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "lora_target_modules": "all-linear",
        "sequence_len": SEQ,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_steps": 8,
        "warmup_steps": 0,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "save_steps": 10_000,
        "gpu_memory_gib": CAP_GIB,
        "device": "cuda",
        "packing": "off",
        **overrides,
    }


def train(config_data: dict, cap_gib: float) -> tuple[dict, dict, list[dict]]:
    """plan + train under an allocator capped at cap_gib; the plan's strategy.json, the train metrics, the
    loss history."""
    gc.collect()  # the previous test's model, before the cap changes
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(
        min(cap_gib, CAP_GIB) * GIB / torch.cuda.get_device_properties(0).total_memory
    )
    config = parse_config(config_data)
    plan = importlib.import_module("loraship.stages.plan").run(config)
    metrics = importlib.import_module("loraship.stages.train").run(config)["metrics"]
    from loraship.runtime.stage import stage_dir

    strategy = json.loads((stage_dir(config, "plan") / "strategy.json").read_text())
    history = [json.loads(x) for x in (stage_dir(config, "train") / "loss_history.jsonl").read_text().splitlines()]
    assert plan["metrics"]["fits"]
    return strategy, metrics, history


def check(strategy: dict, metrics: dict, history: list[dict], cap_gib: float, **forced) -> None:
    # It trained: every loss finite, the end below the start.
    losses = [h["loss"] for h in history]
    assert len(losses) == metrics["steps"] == 8
    assert all(math.isfinite(x) for x in losses), losses
    assert min(losses[-2:]) < losses[0], losses
    # What trained is what was forced, first time.
    assert metrics["oom_retries"] == []
    for key, value in forced.items():
        assert metrics["strategy"][key] == value, (key, metrics["strategy"], metrics["trained_as"])
        assert strategy["strategy"][key] == value
    # Memory: the stage's own measurement against the plan's prediction, and under the cap.
    measured = metrics["measured_memory"]["peak_reserved_gib"]
    predicted = metrics["predicted_reserved_gib"]
    print(
        f"\n{metrics['trained_as']}: peak reserved {measured:.2f} GiB, predicted {predicted:.2f} GiB, "
        f"cap {cap_gib:.2f} GiB, {metrics['tokens_per_s']} tokens/s"
    )
    assert measured <= predicted + prediction_margin_gib(predicted), (measured, predicted)
    assert measured <= cap_gib
    assert metrics["measured_memory"]["peak_allocated_gib"] <= measured


def test_bf16_lora_with_the_fused_loss(gpu_model, tmp_path):
    strategy, metrics, history = train(
        config_dict(gpu_model, tmp_path, "lora", fused_loss="on", gradient_checkpointing=True), CAP_GIB
    )
    check(
        strategy,
        metrics,
        history,
        CAP_GIB,
        adapter="lora",
        offload_layers=0,
        fused_loss=True,
        gradient_checkpointing=True,
    )


def test_nf4_qlora(gpu_model, tmp_path):
    pytest.importorskip("bitsandbytes")
    strategy, metrics, history = train(config_dict(gpu_model, tmp_path, "qlora", adapter="qlora"), CAP_GIB)
    check(strategy, metrics, history, CAP_GIB, adapter="qlora", offload_layers=0)
    assert "QLoRA" in metrics["trained_as"]


def offload_budget(model_dir: Path, data: dict) -> tuple[float, dict]:
    """A gpu_memory_gib (0.05 GiB steps) at which the plan is bf16 LoRA with part of the decoder offloaded,
    as near half of it as the steps allow; found with the planner itself, so the test follows its calibration."""
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training, PlanRefused

    model_config = json.loads((model_dir / "config.json").read_text())
    n_layers = DIMS["num_hidden_layers"]
    found = []
    for i in range(400, 10, -1):
        budget = round(i * 0.05, 2)
        try:
            plan = plan_training(shape_from_config(model_config), parse_config({**data, "gpu_memory_gib": budget}))
        except PlanRefused:
            break
        if plan["strategy"]["adapter"] == "lora" and 0 < plan["strategy"]["offload_layers"] < n_layers:
            found.append((budget, plan["strategy"]))
    assert found, "no budget makes the planner offload part of this model"
    return min(found, key=lambda f: (abs(f[1]["offload_layers"] - n_layers / 2), -f[0]))


def test_bf16_lora_with_partial_cpu_offload(gpu_model, tmp_path):
    data = config_dict(gpu_model, tmp_path, "offload", micro_batch_size=1, fallback=["offload"], fused_loss="on")
    budget, planned = offload_budget(gpu_model, data)
    strategy, metrics, history = train({**data, "gpu_memory_gib": budget}, budget)
    check(strategy, metrics, history, budget, adapter="lora", offload_layers=planned["offload_layers"])
    assert 0 < metrics["strategy"]["offload_layers"] < DIMS["num_hidden_layers"]
    assert "streamed from CPU memory" in metrics["trained_as"]
    # The card holds reserved + the CUDA context: the plan's total must still be within the budget.
    assert metrics["measured_memory"]["peak_reserved_gib"] + strategy["memory"]["cuda_context_gib"] <= budget


def test_packing_on(gpu_model, tmp_path):
    # loraship/training/packed_attention.py through torch's variable-length FlashAttention: the same examples per step
    # as padded batches, so the same losses step for step (bf16 kernels differ: within 2%).
    strategy, metrics, history = train(
        config_dict(gpu_model, tmp_path / "on", "packed", kind="chat", packing="on"), CAP_GIB
    )
    check(strategy, metrics, history, CAP_GIB, adapter="lora", offload_layers=0)
    assert metrics["packing"]["packed"] is True and "(varlen attention" in metrics["packing"]["why"], metrics[
        "packing"
    ]
    assert metrics["train_tokens_this_run"] > 0
    _, padded, padded_history = train(
        config_dict(gpu_model, tmp_path / "off", "padded", kind="chat", packing="off"), CAP_GIB
    )
    assert padded["packing"]["packed"] is False
    for a, b in zip(history, padded_history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), (a, b)


def test_checkpointed_activations_in_cpu_memory(gpu_model, tmp_path):
    # loraship/training/activation_offload.py on CUDA streams: the same losses as torch's checkpointing, step for step.
    common = dict(fused_loss="on", lora_dropout=0.1)
    strategy, metrics, history = train(
        config_dict(gpu_model, tmp_path / "on", "acts", offload_activations="on", **common), CAP_GIB
    )
    check(strategy, metrics, history, CAP_GIB, adapter="lora", offload_layers=0, offload_activations=True)
    assert "checkpointed activations in CPU memory" in metrics["trained_as"]
    # Every checkpointed layer's recompute left down_proj's GEMM out (loraship/training/recompute.py); the losses
    # below match torch's checkpointing all the same.
    assert metrics["down_proj_skipped_in_recompute"] == strategy["strategy"]["checkpointed_layers"] > 0
    _, plain, plain_history = train(
        config_dict(
            gpu_model, tmp_path / "off", "plain", offload_activations="off", gradient_checkpointing=True, **common
        ),
        CAP_GIB,
    )
    assert not plain["strategy"].get("offload_activations")
    for a, b in zip(history, plain_history, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)


def bf16_loss_and_grads(model, ids):
    """One forward and backward under bf16 autocast: the loss and every gradient in fp32."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def worst_cosine(grads: dict, grads_ref: dict) -> float:
    return min(
        torch.nn.functional.cosine_similarity(grads[n].flatten(), grads_ref[n].flatten(), dim=0).item() for n in grads
    )


def test_fused_lora_nodes_match_peft_under_liger(gpu_model):
    """The fused LoRA Linears and the SwiGLU-down node (loraship/training/fused_lora.py) on CUDA, with Liger's kernels
    applied as the train stage applies them, under bf16 autocast: PEFT's loss and LoRA gradients on the same weights
    (bf16 sums in another order: within 1% of the loss, every gradient at cosine >= 0.999)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraship.training.fused_lora import fuse_lora_linears

    def build():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.bfloat16).cuda()
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        with torch.no_grad():  # B starts at zero: a value makes every LoRA gradient and the LoRA term non-zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        _apply_liger_kernel_to_instance(
            model=model.get_base_model(), fused_linear_cross_entropy=True, cross_entropy=False
        )
        return model.train()

    reference, fused = build(), build()
    report = fuse_lora_linears(fused)
    assert report["fused"] == 7 * DIMS["num_hidden_layers"] and report["swiglu_down"] == DIMS["num_hidden_layers"]
    ids = torch.randint(0, 30000, (2, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss_ref, grads_ref = bf16_loss_and_grads(reference, ids)
    loss, grads = bf16_loss_and_grads(fused, ids)
    assert loss == pytest.approx(loss_ref, rel=1e-2)
    assert grads.keys() == grads_ref.keys() and len(grads) == 2 * 7 * DIMS["num_hidden_layers"]
    worst = worst_cosine(grads, grads_ref)
    assert worst >= 0.999, worst


@pytest.mark.parametrize("in_cpu", [True, False])
def test_recompute_without_down_proj_matches_the_full_recompute_under_liger(gpu_model, in_cpu):
    """The recompute skip (loraship/training/recompute.py) on CUDA: all-linear LoRA with the SwiGLU-down node under
    Liger's kernels and bf16 autocast, every layer checkpointed (inputs in CPU memory or torch's non-reentrant
    checkpoint): the same loss and LoRA gradients as the full recompute (cosine >= 0.9999: the same kernels on the
    same values, so any gap is an error, not rounding)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraship.training.activation_offload import offload_checkpointed_activations
    from loraship.training.fused_lora import fuse_lora_linears
    from loraship.training.recompute import skip_down_proj_in_recompute

    L = DIMS["num_hidden_layers"]

    def build(skip: bool):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.bfloat16).cuda()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        layers = list(model.get_base_model().model.layers)
        if in_cpu:
            offload_checkpointed_activations(layers, L)
        _apply_liger_kernel_to_instance(
            model=model.get_base_model(), fused_linear_cross_entropy=True, cross_entropy=False
        )
        assert fuse_lora_linears(model)["swiglu_down"] == L
        if skip:
            assert skip_down_proj_in_recompute(layers, L, offloaded=in_cpu) == L
        return model.train()

    ids = torch.randint(0, 30000, (2, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss_ref, grads_ref = bf16_loss_and_grads(build(False), ids)
    loss, grads = bf16_loss_and_grads(build(True), ids)
    assert loss == pytest.approx(loss_ref, rel=1e-4)
    assert grads.keys() == grads_ref.keys() and len(grads) == 2 * 7 * L
    worst = worst_cosine(grads, grads_ref)
    assert worst >= 0.9999, worst


@pytest.mark.parametrize(
    "rows,width,offset,mode,in_place",
    [(4096, 3840, 1.0, "gemma", False), (4096 * 16, 256, 1.0, "gemma", False), (2 * 4096, 4096, 0.0, "llama", True)],
)
def test_spread_norm_backward_matches_liger_on_real_widths(rows, width, offset, mode, in_place):
    """loraship/training/rms_norm_backward.py against Liger's own backward, on Gemma-3-12B's layer and per-head norms
    and a Llama layer norm (in place), bf16 on the GPU."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    from loraship.training.rms_norm_backward import FrozenWeightRMSNorm

    torch.manual_seed(0)
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    w = (torch.randn(width, device="cuda") * 0.1).to(torch.bfloat16)
    dy = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    grads = []
    for fn in (LigerRMSNormFunction, FrozenWeightRMSNorm):
        xi = x.clone().requires_grad_()
        y = fn.apply(xi, w, 1e-6, offset, mode, in_place, None)
        y.backward(dy.clone())
        grads.append((y.detach(), xi.grad))
    (y_liger, dx_liger), (y_ours, dx_ours) = grads
    assert torch.equal(y_ours, y_liger)  # the same forward kernel
    torch.testing.assert_close(dx_ours.float(), dx_liger.float(), rtol=2e-2, atol=2e-2)
    assert (dx_ours.float() - dx_liger.float()).abs().mean() < 2e-3 * dx_liger.float().abs().mean()


@pytest.mark.parametrize("rows,vocab,width", [(4096, 262144, 3840), (8192, 128256, 4096), (4096, 151936, 4096)])
def test_wider_loss_chunks_give_liger_default_loss_and_gradient(rows, vocab, width):
    """loraship/training/loss_chunks.py on Liger's real kernels, bf16 at Gemma 3's, Llama 3's and Qwen's vocabularies:
    the chunk train runs gives the loss and input gradient of Liger's default chunk."""
    import liger_kernel.transformers.functional as liger_functional

    from loraship.training.loss_chunks import widen_loss_chunks

    torch.manual_seed(0)
    hidden = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16) / width**0.5
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[:100] = -100
    current = liger_functional.liger_fused_linear_cross_entropy
    default = getattr(current, "__wrapped__", current)  # Liger's own, were it wrapped already
    widen_loss_chunks()
    results = []
    for fn in (default, liger_functional.liger_fused_linear_cross_entropy):
        x = hidden.clone().requires_grad_()
        loss = fn(x, weight, target)
        loss.backward()
        results.append((loss.item(), x.grad.float()))
    (loss_default, grad_default), (loss_wide, grad_wide) = results
    assert loss_wide == pytest.approx(loss_default, rel=1e-5)
    torch.testing.assert_close(grad_wide, grad_default, rtol=1e-2, atol=1e-5)


def test_heads_first_norms_feed_rope_and_flex_attention_without_copies():
    """Gemma-3-12B's q/k path at 4096 tokens (16 query heads, 8 KV heads, head_dim 256, a 1024-token window): the
    projection's heads-first view -> per-head norm -> Liger's RoPE -> compiled flex attention -> the tokens-first
    output transformers makes contiguous, then backward. loraship's norm keeps the projection's layout
    (loraship/training/rms_norm_backward.py heads_first_view); against Liger's own norm, which copies to heads-first:
    the same outputs and gradients, and fewer copy kernels (9 against 1 on an H100:
    bench/results/train_bench_gemma3_copies.json)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.profiler import ProfilerActivity, profile

    from loraship.training.rms_norm_backward import FrozenWeightRMSNorm

    T, HQ, HKV, D, WINDOW = 4096, 16, 8, 256, 1024
    torch.manual_seed(0)
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    xq, xk, xv = (torch.randn(1, T, h * D, **cuda) for h in (HQ, HKV, HKV))
    wq, wk = (torch.randn(D, **cuda) * 0.1 for _ in range(2))
    angles = torch.arange(T, device="cuda")[:, None] / 10000 ** (torch.arange(0, D, 2, device="cuda") / D)
    angles = torch.cat([angles, angles], -1)[None]
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    g = torch.randn(1, T, HQ * D, **cuda)
    mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW), None, None, T, T, device="cuda")
    attend = torch.compile(flex_attention)

    def run(norm):
        leaves = [x.clone().requires_grad_() for x in (xq, xk, xv)]
        q, k, v = (x.view(1, T, -1, D).transpose(1, 2) for x in leaves)
        q = norm.apply(q, wq, 1e-6, 1.0, "gemma", False, None)
        k = norm.apply(k, wk, 1e-6, 1.0, "gemma", False, None)
        q, k = LigerRopeFunction.apply(q, k, cos, sin)[:2]  # 0.8.5 gives (q, k); later ones cos and sin too
        out = attend(q, k, v, block_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).contiguous().view(1, T, -1)  # transformers' flex_attention_forward
        out.backward(g)
        return [out.detach()] + [x.grad for x in leaves]

    def copy_kernels(norm):
        run(norm)  # compiled for this layout first
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            results = run(norm)
            torch.cuda.synchronize()
        return results, sum(e.count for e in prof.key_averages() if "copy" in e.key.lower())

    (theirs, liger_copies), (ours, our_copies) = copy_kernels(LigerRMSNormFunction), copy_kernels(FrozenWeightRMSNorm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert (a.float() - b.float()).abs().mean() < 1e-2 * b.float().abs().mean()
    assert liger_copies >= 4, liger_copies  # the norms' and RoPE's copies, at least, on Liger's path
    assert our_copies < liger_copies, (our_copies, liger_copies)
    print(f"copy kernels on the q/k path: Liger's norm {liger_copies}, loraship's {our_copies}")


def test_a_heads_first_norm_with_a_trainable_weight_gives_liger_gradients():
    """The heads-first layout on the path where the norm's weight trains (Liger's own backward, dW summed per SM):
    the input's and the weight's gradients equal Liger's on a contiguous copy, at Gemma-3-12B's per-head width."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    from loraship.training.rms_norm_backward import FrozenWeightRMSNorm

    torch.manual_seed(0)
    projection = torch.randn(2, 2048, 16, 256, device="cuda", dtype=torch.bfloat16) * 3  # [batch, tokens, heads, dim]
    weight = (torch.randn(256, device="cuda") * 0.1).to(torch.bfloat16)
    dy = torch.randn(2, 2048, 16, 256, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    grads = []
    for fn, layout in ((LigerRMSNormFunction, torch.Tensor.contiguous), (FrozenWeightRMSNorm, lambda t: t)):
        x = projection.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        y = fn.apply(layout(x.transpose(1, 2)), w, 1e-6, 1.0, "gemma", False, None)
        y.backward(dy.clone())
        grads.append((y.detach().contiguous(), x.grad, w.grad))
    (y_liger, dx_liger, dw_liger), (y_ours, dx_ours, dw_ours) = grads
    assert torch.equal(y_ours, y_liger)
    torch.testing.assert_close(dx_ours.float(), dx_liger.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw_ours.float(), dw_liger.float(), rtol=2e-2, atol=2e-1)
