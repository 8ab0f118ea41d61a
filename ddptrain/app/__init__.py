"""The command line: compose the config (``cli``), print ``--help``, run sweeps (``sweep``, ``submit``), start
workers or train here (``launch``)."""
