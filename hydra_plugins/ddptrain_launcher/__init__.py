"""ddptrain's Hydra launcher plugin (``hydra/launcher=ddptrain``, the default of ``ddptrain -m``)."""
