"""Session-wide test settings that must be in place before any test module imports its libraries."""

import os

# Triton decides between compiling and interpreting when a kernel is first defined, and several libraries
# the suite imports (transformers, bitsandbytes, torch's inductor) import Triton on their own: so the
# interpreter, which runs our kernels on CPU tensors, is switched on here, before any of them.
# tests/test_kernels_gpu.py runs its CUDA checks in a fresh interpreter without it.
os.environ.setdefault("TRITON_INTERPRET", "1")
