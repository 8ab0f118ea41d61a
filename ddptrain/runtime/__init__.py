"""Where this process runs: the process group's lifecycle (``process_group``), the ranks' hosts and nodes
(``topology``), and the points where hooks may act in a run (``hooks``)."""
