"""The trainer (``trainer.py``: its parts, built once, its step and its loop; ``train`` its entry), the pieces of a
step (``step.py``) and what watches it (``observer.py``).

Nothing is imported here: the step's pieces (``step``, ``control``, ``tokens``, ``weighting``) sit below the
planner, which runs them on fake tensors, and importing one must not import the trainer, which sits above it.
"""
