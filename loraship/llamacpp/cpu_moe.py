"""llama.cpp's `--n-cpu-moe N` under llama-cpp-python, which has no argument for it: the routed-expert tensors of
blocks 0..N-1 loaded into CPU memory, the rest of every layer where n_gpu_layers puts it. llama-server builds the
same tensor-buffer-type overrides from its flag (the pinned llama.cpp's common/common.h, llm_add_n_cpu_ffn_overrides),
one pattern per block; here they are set on the model parameters every later llama_cpp.Llama of the process loads
with. Only the standard library is imported at the top: verify's measuring child loads the GGUF before numpy
(loraship/verification/measure_child.py says why)."""

from __future__ import annotations

import sys

# LLM_FFN_EXPS_REGEX of the pinned llama.cpp: the routed experts' up, down, gate (or fused gate_up) tensors; the
# shared experts (ffn_*_shexp) and the router (ffn_gate_inp) stay with their layer.
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
FLAG = "--n-cpu-moe"


def block_patterns(n_cpu_moe: int) -> list[str]:
    """llama.cpp's override patterns for `--n-cpu-moe n_cpu_moe`: one per block, blk.0 first."""
    return [rf"blk\.{i}{EXPERTS_REGEX}" for i in range(max(0, n_cpu_moe))]


def keep_experts_in_cpu_memory(n_cpu_moe: int) -> list[str]:
    """From now on every llama_cpp.Llama this process loads keeps the experts of its first n_cpu_moe blocks in CPU
    memory (llama.cpp's CPU buffer type, its repacked variants included, as --n-cpu-moe); the patterns set."""
    patterns = block_patterns(n_cpu_moe)
    if not patterns:
        return []
    import ctypes

    import llama_cpp.llama_cpp as api

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    cpu_buffer_type = api._lib.ggml_backend_cpu_buffer_type
    cpu_buffer_type.argtypes, cpu_buffer_type.restype = [], ctypes.c_void_p
    cpu = cpu_buffer_type()
    # NULL-terminated, as llama_model_params.tensor_buft_overrides is read; kept alive on the function below.
    overrides = (Override * (len(patterns) + 1))(*(Override(p.encode(), cpu) for p in patterns), Override(None, None))
    default_params = api.llama_model_default_params

    def with_overrides():
        params = default_params()
        params.tensor_buft_overrides = ctypes.addressof(overrides)
        return params

    with_overrides.overrides = overrides
    api.llama_model_default_params = with_overrides
    return patterns


def serve(argv: list[str]) -> None:
    """llama-cpp-python's server (python -m llama_cpp.server) taking llama-server's `--n-cpu-moe N` besides its own
    arguments: the experts are placed before the server loads the model."""
    args = list(argv)
    if FLAG in args:
        at = args.index(FLAG)
        keep_experts_in_cpu_memory(int(args[at + 1]))
        del args[at : at + 2]
    from llama_cpp.server.__main__ import main

    sys.argv = ["llama_cpp.server", *args]
    main()


if __name__ == "__main__":
    serve(sys.argv[1:])
