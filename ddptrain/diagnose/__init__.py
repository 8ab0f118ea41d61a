"""Naming hangs and deaths: each rank's evidence in the run dir, and the launcher's one-sentence verdict."""
