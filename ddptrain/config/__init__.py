"""Configuration: the typed schema (``schema``) and its choices, and Hydra composition onto it, typed once per run
(``compose``). It imports nothing of the packages that read it; the start-up checks that need them (devices,
files, the world size) are the app's preflight (``ddptrain/app/preflight.py``)."""
