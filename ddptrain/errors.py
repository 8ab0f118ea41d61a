"""User-facing errors: one line that names the key or file and what was expected."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys

from hydra.errors import MissingConfigException
from omegaconf.errors import OmegaConfBaseException

_IN_PRIMARY = re.compile(r"^In '[^']*': ")  # Hydra names the primary config that failed to compose
_UNKNOWN_KEY = re.compile(r"Key '[^']*' not in '")
_INVALID_CHOICE = re.compile(r"Invalid value (?P<value>'.*'), expected one of \[(?P<allowed>.*)\]")


class ConfigError(Exception):
    """Bad input from the user. The CLI prints it as one line and exits non-zero on every rank."""


class ResourceError(Exception):
    """The machine lacks what the run needs (room on disk). The CLI prints it as one line and exits 1 on every
    rank."""


class RunEnded(Exception):
    """The run ended early on purpose (a requested stop, an aborted non-finite step); the message says why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class QuorumLost(RunEnded):
    """A replica group found no quorum of ``ft.min_replicas`` groups in time. Under the groups' launcher the line
    is the launcher's: it reads the loss from the group's events and knows whether the other groups went on (the
    run stops) or not (this group failed alone and restarts)."""


class PeerLost(RunEnded):
    """A collective timed out or lost a peer: this rank says what it waited in, the launcher names who is at fault."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1)


def one_line(exc: BaseException) -> str:
    """Condense a Hydra/OmegaConf composition error (several lines, a wrapped cause) into one line."""
    if isinstance(exc, MissingConfigException):
        lines = str(exc).splitlines()
        first = _IN_PRIMARY.sub("", lines[0])
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        return f"{first}; available: {', '.join(options)}" if options else first
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    if isinstance(cause, OmegaConfBaseException):
        message = str(cause).splitlines()[0]
        key = getattr(cause, "full_key", None)
        if key and (choice := _INVALID_CHOICE.match(message)):  # a schema Enum: name the key and the choices
            return f"{key}={choice['value']}: expected one of {choice['allowed']}"
        if key and (hint := _hint(cause, str(key), message)):
            return f"{key}: {message.rstrip('.')}; {hint}"
        return f"{key}: {message}" if key else message
    return flat(str(exc))


def _hint(cause: OmegaConfBaseException, key: str, message: str) -> str:
    """What the user probably meant: the schema's closest key for an unknown one (``train.max_steps``: did you
    mean ``train.steps``?), brackets for a list given as a bare value (``data.paths=/x``: ``[/x]``)."""
    if _UNKNOWN_KEY.match(message):
        schema = getattr(cause, "object_type", None)
        known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        name = key.rpartition(".")[2]
        close = difflib.get_close_matches(name, known, n=1)
        return f"did you mean {key[: len(key) - len(name)]}{close[0]}?" if close else ""
    if "is not a ListConfig, list or tuple" in message:
        value = getattr(cause, "value", None)
        return f"a list is written in brackets: {key}=[{value if value is not None else '...'}]"
    return ""


def flat(text: str, limit: int = 300) -> str:
    """Any message as one line (whitespace and newlines collapsed), at most ``limit`` characters."""
    return " ".join(text.split())[:limit]


def say(line: str) -> None:
    """One line to stderr in a single write: lines of ranks sharing a pipe never interleave (print writes the
    text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
