"""Fault-tolerant data parallelism across replica groups, on torchft (the extra ``ddptrain[ft]``).

``ft.replica_groups=R``: R groups of ``launch.nproc_per_node`` workers each train one model together. Inside a group
the ranks are an ordinary torch DDP job; across groups a torchft ``Manager`` keeps a quorum through a lighthouse,
averages the gradients over the groups that take part in a step, and lets a group that died and came back copy the
live state of a peer (a heal) instead of stopping every rank.

- ``extra``: the one-line refusal without torchft installed.
- ``layout``: where a group writes (its own subdirectory of the run dir), its data-parallel rank and size.
- ``lighthouse``: the wheel's ``torchft_lighthouse``, started and stopped here for a local run.
- ``launch``: the local launcher: the lighthouse and one elastic agent per group.
- ``replica``: the worker's side: the Manager, each step's quorum, gradient average and commit, the heal.
- ``accounting``: ``ft.json`` from the groups' event files.
- ``diloco``: DiLoCo and Streaming DiLoCo (``ft.sync``) on torchft's ``local_sgd.DiLoCo``: the outer sync.
"""
