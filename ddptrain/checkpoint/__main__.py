"""``python -m ddptrain.checkpoint``: the ``ddptrain-ckpt`` command (``ddptrain/checkpoint/cli.py``), an entry point."""

from ddptrain.checkpoint.cli import main

main()
