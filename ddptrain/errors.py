"""User-facing errors: one line that names the key or file and what was expected."""

from __future__ import annotations

from hydra.errors import MissingConfigException
from omegaconf.errors import OmegaConfBaseException


class ConfigError(Exception):
    """Bad input from the user. The CLI prints it as one line and exits non-zero on every rank."""


class RunEnded(Exception):
    """The run ended early on purpose (a requested stop, an aborted non-finite step); the message says why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """An error's text on one line, at most ``limit`` characters: a Hydra/OmegaConf composition error (several
    lines, a wrapped cause) condensed to its key and message, anything else with its whitespace collapsed."""
    if isinstance(exc, MissingConfigException):
        lines = str(exc).splitlines()
        first = lines[0].removeprefix("In 'config': ")
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        text = f"{first}; available: {', '.join(options)}" if options else first
    else:
        cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
        if isinstance(cause, OmegaConfBaseException):
            message = str(cause).splitlines()[0]
            key = getattr(cause, "full_key", None)
            text = f"{key}: {message}" if key else message
        else:
            text = " ".join(str(exc).split())
    return text[:limit]
