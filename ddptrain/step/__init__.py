"""The pieces of one training step, with no trainer state: the micro batches' forward and backward, clip and update
(``compute.py``), the loss guard and the ranks' agreement (``control.py``), the token counts (``tokens.py``) and the
loss weighting (``weighting.py``).

A package of its own, below ``plan``: the memory planner runs these very functions on fake tensors (one definition
of a step), and the trainer (``train``), which plans its own run, sits above both.
"""
