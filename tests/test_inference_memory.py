"""verify's GPU memory prediction (loraship/planning/inference_memory.py) against what llama.cpp itself
logged on the H200 (bench/results/verify_gpu*.json), and llama.cpp's n_gpu_layers meaning."""

from __future__ import annotations

import pytest

from loraship.planning import inference_memory as im

MIB = 2**20


def layout(n_layers, n_embd, n_head, n_head_kv, n_ff, block_bytes=100 * MIB, output_bytes=426 * MIB):
    return im.GGUFLayout(
        n_layers=n_layers,
        layer_bytes=[block_bytes] * n_layers,
        output_bytes=output_bytes,
        cpu_bytes=292 * MIB,
        n_embd=n_embd,
        n_embd_kv=n_head_kv * (n_embd // n_head),
        n_head=n_head,
        n_ff=n_ff,
        n_vocab=152064,
        n_ctx_train=32768,
    )


QWEN2_7B = layout(28, 3584, 28, 4, 18944)
QWEN2_14B = layout(48, 5120, 40, 8, 13824)


# llama.cpp's "CUDA0 compute buffer size" and "CUDA0 KV buffer size" (MiB), every layer on the GPU.
@pytest.mark.parametrize(
    "shape, n_ctx, compute_mib, kv_mib",
    [
        (QWEN2_7B, 1024, 304.0, 64.0 * 28 / 8 / 4),
        (QWEN2_7B, 4096, 304.0, 224.0),
        (QWEN2_7B, 16384, 958.01, 256.0 * 28 / 8),
        (QWEN2_14B, 4096, 372.01, 768.0),
    ],
)
def test_compute_buffer_and_kv_cache_match_llama_cpp_logs(shape, n_ctx, compute_mib, kv_mib):
    predicted = im.predict_gpu(shape, n_ctx)
    assert predicted["compute_buffer_gib"] * 1024 == pytest.approx(compute_mib, rel=0.02)
    assert predicted["kv_cache_gib"] * 1024 == pytest.approx(kv_mib, rel=0.02)


def test_n_gpu_layers_counts_the_output_layer_first_as_llama_cpp_does():
    shape = QWEN2_7B
    every = im.all_layers(shape)
    assert every == 29
    assert im.predict_gpu(shape, 4096) == im.predict_gpu(shape, 4096, every) == im.predict_gpu(shape, 4096, -1)
    only_output = im.predict_gpu(shape, 4096, 1)
    assert only_output["weights_gib"] == pytest.approx(426 / 1024, abs=1e-3) and only_output["kv_cache_gib"] == 0
    # k layers: the output layer and k - 1 blocks, each with its KV cache ("offloaded 8/9 layers")
    eight = im.predict_gpu(shape, 4096, 8)
    assert eight["weights_gib"] == pytest.approx((426 + 7 * 100) / 1024, abs=1e-3)
    assert eight["kv_cache_gib"] == pytest.approx(224 / 28 * 7 / 1024, abs=1e-3)
    assert im.predict_gpu(shape, 4096, 0)["total_gib"] == pytest.approx(im.CUDA_OVERHEAD_GIB)


def test_layers_that_fit_is_the_largest_count_under_budget_and_never_the_output_layer_alone():
    shape = QWEN2_7B
    budget = im.predict_gpu(shape, 4096, 19)["total_gib"] + 0.001
    assert im.layers_that_fit(shape, 4096, budget) == 19
    assert im.predict_gpu(shape, 4096, 20)["total_gib"] > budget
    only_output = im.predict_gpu(shape, 4096, 1)["total_gib"]
    assert im.layers_that_fit(shape, 4096, only_output + 0.001) == 0


def test_largest_context_grows_with_the_budget():
    small = im.largest_context(QWEN2_7B, im.predict_gpu(QWEN2_7B, 2048)["total_gib"])
    assert small == 2048
    assert im.largest_context(QWEN2_7B, 1.0) == 0
