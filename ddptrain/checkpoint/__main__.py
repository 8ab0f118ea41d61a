"""``python -m ddptrain.checkpoint``: the ``ddptrain-ckpt`` command (``ddptrain/app/ckpt.py``), an entry point."""

from ddptrain.app.ckpt import main

main()
