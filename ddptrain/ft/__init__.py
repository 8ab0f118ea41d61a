"""Fault-tolerant data parallelism across replica groups through torchft (the ``ft`` extra)."""
