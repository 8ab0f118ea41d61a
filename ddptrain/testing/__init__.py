"""Test support that ships with the package because the tests drive it inside real worker processes (through
``DDPTRAIN_FAULT``): fault injection. Only the trainer's build (``train/trainer.py``) imports it, to give the loop
and the checkpointer their hooks."""
