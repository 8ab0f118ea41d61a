"""A Dockerfile's build context and Python steps, without a Docker engine.

No Docker engine runs here, so the image is never built; what can go wrong in its Python steps can still be
checked. ``assemble`` copies into a directory exactly what the Dockerfile's ``COPY`` lines take from the build
context, as the builder would: the sources named (globs too), less what ``.dockerignore`` drops, into the image's
``WORKDIR``. ``pip_step`` is the image's ``pip install --no-deps .`` turned into ``pip wheel --no-deps .`` with the
same options, so the project builds from that directory alone, as it would in the image.

``.dockerignore`` follows Docker's rules (moby's ``patternmatcher``): one pattern a line, ``#`` comments, a leading
``/`` ignored, ``*`` and ``?`` within one path element, ``**`` across any number of them, ``!`` re-includes, the
last pattern that matches a path decides, and a pattern that matches a directory covers everything under it.

What it does not model: multi-stage builds (``COPY --from``), ``ADD``, build arguments inside ``COPY`` paths,
``COPY``'s ``--exclude``/``--parents``, and the owner and mode of the copied files.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, as (keyword, arguments): continuation lines joined, comments out."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


@dataclass(frozen=True)
class Pattern:
    regex: re.Pattern[str]
    exclusion: bool  # a "!" line: re-includes what it matches


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and (end := pattern.find("]", i)) > i:
            body = pattern[i + 1:end]
            out, i = out + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]", end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def ignore_patterns(text: str) -> list[Pattern]:
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        cleaned = str(PurePosixPath("/" + line.removeprefix("!").strip())).lstrip("/")
        if cleaned:
            patterns.append(Pattern(_regex(cleaned), exclusion))
    return patterns


def ignored(path: str, patterns: list[Pattern]) -> bool:
    """Whether Docker leaves ``path`` (relative to the context, with ``/``) out of the build context."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    matched = False
    for pattern in patterns:
        if any(pattern.regex.match(p) for p in prefixes):
            matched = not pattern.exclusion
    return matched


class ContextError(Exception):
    """What ``docker build`` would stop with."""


def _copy_args(arguments: str) -> list[str]:
    if arguments.startswith("["):
        return list(json.loads(arguments))
    words = shlex.split(arguments)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith(("--from", "--exclude", "--parents")) for f in flags):
        raise ContextError(f"COPY {arguments}: {flags} is not modelled")
    return [w for w in words if not w.startswith("--")]


def _context_files(context: Path, source: str, patterns: list[Pattern]) -> list[tuple[Path, str]]:
    """(file, its path under the copied source) for every file ``source`` names that the context holds."""
    names = sorted(context.glob(source)) if any(c in source for c in "*?[") else [context / source]
    found = []
    for name in names:
        if not name.exists():
            continue
        files = [name] if name.is_file() else sorted(p for p in name.rglob("*") if p.is_file())
        for file in files:
            relative = file.relative_to(context).as_posix()
            if not ignored(relative, patterns):
                found.append((file, file.name if file == name else file.relative_to(name).as_posix()))
    return found


def assemble(context: Path, into: Path, dockerfile: str, ignore: str, until: str) -> Path:
    """Copy what the ``COPY`` lines before the first ``RUN`` containing ``until`` take from ``context`` into
    ``into`` (the image's file system); returns that step's working directory there."""
    patterns = ignore_patterns(ignore)
    workdir = PurePosixPath("/")
    for keyword, arguments in instructions(dockerfile):
        if keyword == "WORKDIR":
            workdir = workdir / arguments
        elif keyword == "RUN" and until in arguments:
            return into / str(workdir).lstrip("/")
        elif keyword == "COPY":
            *sources, dest = _copy_args(arguments)
            target = workdir / dest
            into_dir = dest.endswith("/") or len(sources) > 1
            for source in sources:
                files = _context_files(context, source.lstrip("/"), patterns)
                if not files:
                    raise ContextError(f"COPY {arguments}: {source!r} not found in the build context "
                                       "(absent, or left out by .dockerignore)")
                whole_dir = (context / source).is_dir()
                for file, below in files:
                    path = target / below if whole_dir or into_dir else target
                    out = into / str(path).lstrip("/")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, out)
    raise ContextError(f"no RUN step containing {until!r}")


def pip_step(dockerfile: str, install: str, wheel_dir: Path) -> list[str]:
    """The image's ``pip install`` command that contains ``install``, as ``pip wheel`` arguments with the same
    options, writing into ``wheel_dir`` (without ``pip``: run them with this interpreter's ``-m pip``)."""
    for keyword, arguments in instructions(dockerfile):
        if keyword == "RUN" and install in arguments:
            command = next(part for part in arguments.split("&&") if install in part)
            words = shlex.split(command)
            start = words.index("pip")
            if words[start + 1] != "install":
                raise ContextError(f"RUN {command}: expected pip install")
            return ["wheel", *words[start + 2:], "--wheel-dir", str(wheel_dir)]
    raise ContextError(f"no RUN step containing {install!r}")
