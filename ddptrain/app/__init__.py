"""The commands: ``ddptrain`` composes the config (``cli``), prints ``--help``, runs sweeps (``sweep``), checks the
config against the machine and the data (``preflight``), starts workers or trains here (``launch``);
``ddptrain-ckpt`` inspects, exports and verifies checkpoints offline (``ckpt``)."""
