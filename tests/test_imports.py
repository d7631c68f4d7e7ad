"""loraship/runtime/imports.py: peft without inductor, torch.compile left as it was."""

import subprocess
import sys
import textwrap


def test_peft_imports_bitsandbytes_without_inductor_and_leaves_torch_compile_alone():
    child = textwrap.dedent(
        """
        import sys
        import torch
        compile_ = torch.compile
        from loraship.runtime.imports import import_peft
        peft = import_peft()
        assert torch.compile is compile_
        assert "bitsandbytes" in sys.modules and peft.LoraConfig
        assert "torch._inductor.compile_fx" not in sys.modules, "inductor imported"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
