"""Where this process runs: the process group's lifecycle (``process_group``) and the ranks' hosts and nodes
(``topology``)."""
