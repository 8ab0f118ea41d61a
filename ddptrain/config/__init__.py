"""Configuration: the typed schema (``schema``) and its choices, Hydra composition onto it (``compose``), and the
start-up checks that need more than the config (``checks``)."""
