"""The trainer (``trainer.py``: its parts, built once, its step and its loop; ``train`` its entry) and what watches
it (``observer.py``). The step's pieces it puts in order are the package below the planner, ``ddptrain.step``."""
