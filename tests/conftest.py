"""Session-wide test settings that must be in place before any test module imports its libraries."""

import os
from pathlib import Path

import pytest

# Triton decides between compiling and interpreting when a kernel is first defined, and several libraries
# the suite imports (transformers, bitsandbytes, torch's inductor) import Triton on their own: so the
# interpreter, which runs our kernels on CPU tensors, is switched on here, before any of them.
# tests/test_kernels_gpu.py runs its CUDA checks in a fresh interpreter without it.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def pretrained_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny "pretrained" Llama and its tokenizer, saved with save_pretrained (what a user brings); loaded through
    ``model.pretrained`` as users load theirs."""
    from ddptrain.data.instruct import generated_instructions
    from ddptrain.data.tokenizer import train_bpe
    from tests.helpers.pretrained import save_tiny_llama

    out = tmp_path_factory.mktemp("pretrained_base")
    tok = train_bpe([f"{p} {c}" for p, c in generated_instructions(400)], 320)
    save_tiny_llama(out, eos_id=tok.eos_token_id)
    tok.save_pretrained(out)
    return out
