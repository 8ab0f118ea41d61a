"""Raw documents for each ``data.source``, with a fingerprint that keys the token cache."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ddptrain.config.choices import DataFormat
from ddptrain.config.schema import DataConfig
from ddptrain.errors import ConfigError, flat

READS = {  # the sources each data.format can read; instructions: prompt/completion pairs generated locally
    DataFormat.packed: ("stdlib_code", "synthetic", "files", "hub"),
    DataFormat.prompt_completion: ("files", "hub", "instructions"),
}
FILE_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


@dataclass
class Corpus:
    """A corpus read as a stream: ``documents()`` yields its non-empty texts in a fixed order, one bounded batch of
    records at a time (Arrow record batches, JSON lines, one file), never the whole column."""

    documents: Callable[[], Iterator[str]]
    fingerprint: str  # changes whenever the documents could have changed
    size_hint: int  # about how many bytes of text it holds (for progress and ETA); 0 when unknown


def validate_source(cfg: DataConfig) -> None:
    """Checks that look at the file system (a stat, no reads): files that exist, a tokenizer directory; and
    which sources a data.format reads."""
    if cfg.source not in READS[cfg.format]:
        raise ConfigError(f"data.format={cfg.format} cannot read data.source={cfg.source}: expected one of "
                          f"{', '.join(READS[cfg.format])}")
    if cfg.source == "files":
        for path in cfg.paths:
            suffix = Path(path).suffix.lower()
            if suffix not in FILE_LOADERS:
                raise ConfigError(f"data.paths: {path}: expected one of {', '.join(FILE_LOADERS)} files")
            if not Path(path).is_file():
                raise ConfigError(f"data.paths: {path}: no such file")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"data.paths: {path}: not readable")
            if Path(path).stat().st_size == 0:
                raise ConfigError(f"data.paths: {path}: the file is empty")
        if cfg.format == DataFormat.prompt_completion and any(FILE_LOADERS[Path(p).suffix.lower()] == "text"
                                                              for p in cfg.paths):
            raise ConfigError("data.paths: prompt_completion records need .jsonl/.json or .parquet files")
        if len({FILE_LOADERS[Path(p).suffix.lower()] for p in cfg.paths}) > 1:
            raise ConfigError("data.paths: expected files of one kind (all text, all json or all parquet)")
    if cfg.format == DataFormat.prompt_completion and cfg.tokenizer is None:
        raise ConfigError("data.tokenizer: prompt_completion data needs the model's own tokenizer (a local "
                          "directory; data=instruct takes model.pretrained's)")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(f"data.tokenizer={cfg.tokenizer}: expected a local tokenizer directory")


def stdlib_files() -> list[Path]:
    """The standard library's own .py sources on this machine, tests excluded, in a stable order. The skipped
    directories are not entered (walking them and filtering afterwards took 0.3 s of every run's start-up)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):  # symlinked folders not entered
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.source == "stdlib_code":
        return _stdlib_corpus(cfg)
    if cfg.source == "files":
        return _files_corpus(cfg)
    if cfg.source == "hub":
        return _hub_corpus(cfg)
    raise ConfigError(f"data.source={cfg.source!r} has no documents")


def _capped(texts: Iterable[object], cfg: DataConfig) -> Iterator[str]:
    """Non-empty strings only, at most ``data.max_documents`` of them."""
    kept = (t for t in texts if isinstance(t, str) and t.strip())
    return itertools.islice(kept, cfg.max_documents)


def _stdlib_corpus(cfg: DataConfig) -> Corpus:
    files = stdlib_files()[: cfg.max_documents]
    if not files:
        raise ConfigError(f"data.source=stdlib_code: no .py files under {sysconfig.get_paths()['stdlib']}")
    digest = hashlib.sha256()
    sizes = [p.stat().st_size for p in files]
    for path, size in zip(files, sizes, strict=True):
        digest.update(f"{path.name}:{size}".encode())

    def documents() -> Iterator[str]:
        return _capped((p.read_bytes().decode("utf-8", errors="replace") for p in files), cfg)

    return Corpus(documents, digest.hexdigest()[:16], sum(sizes))


def _files_corpus(cfg: DataConfig) -> Corpus:
    kind = FILE_LOADERS[Path(cfg.paths[0]).suffix.lower()]
    digest = hashlib.sha256()
    for p in cfg.paths:
        st = Path(p).stat()
        digest.update(f"{Path(p).absolute()}:{st.st_size}:{st.st_mtime_ns}:{cfg.text_field}".encode())
    reader = _text_file if kind == "text" else _field_of

    def documents() -> Iterator[str]:
        return _capped((t for p in cfg.paths for t in reader(Path(p), cfg.text_field)), cfg)

    return Corpus(documents, digest.hexdigest()[:16], sum(_text_bytes(Path(p), kind, cfg.text_field)
                                                          for p in cfg.paths))


def _text_file(path: Path, _field: str) -> Iterator[str]:
    """A .txt file is one document."""
    yield path.read_bytes().decode("utf-8", errors="replace")


def records_of(path: Path, columns: list[str]) -> Iterator[tuple[str, dict[str, object]]]:
    """The records of a JSON Lines or parquet file, one at a time, each with where it is (``line 7`` of a JSON
    Lines file, ``record 7`` of a parquet file, counted from 1); parquet: only ``columns``, read in Arrow record
    batches. Blank lines between JSON records are skipped."""
    if FILE_LOADERS[path.suffix.lower()] == "parquet":
        yield from _parquet_records(path, columns)
        return
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
                raise ConfigError(f"data.paths: {path}: line {number} is not JSON ({why}); expected JSON Lines, one "
                                  "object per line") from None
            if not isinstance(record, dict):
                array = " (JSON Lines, not one JSON array)" if isinstance(record, list) else ""
                raise ConfigError(f"data.paths: {path}: line {number} is {json_kind(record)}, expected a JSON object "
                                  f"per line{array}")
            yield f"line {number}", record


def json_kind(value: object) -> str:
    """What a decoded value is, in JSON's words: ``null``, ``a number``, ``a list``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _parquet_records(path: Path, columns: list[str],
                     batch_rows: int = 1024) -> Iterator[tuple[str, dict[str, object]]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        raise ConfigError(f"data.paths: cannot read as parquet: {path}: {flat(str(exc), 200)}") from exc
    present = [c for c in columns if c in parquet.schema_arrow.names]
    if len(present) < len(columns):  # a record without the column: the caller names the key
        yield "record 1", {name: None for name in parquet.schema_arrow.names}
        return
    number = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=present):
        for record in batch.to_pylist():
            number += 1
            yield f"record {number}", record


def _field_of(path: Path, field: str) -> Iterator[object]:
    for _, record in records_of(path, [field]):
        if field not in record:
            raise ConfigError(f"data.text_field={field!r}: not a column of {path}; columns: {sorted(record)}")
        yield record[field]


def _text_bytes(path: Path, kind: str, field: str) -> int:
    """About how many bytes of text a file holds: its size, or a parquet column's uncompressed size."""
    if kind != "parquet":
        return path.stat().st_size
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError; reading it later names the file
        return path.stat().st_size
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if field not in names:
        return path.stat().st_size
    column = names.index(field)
    return sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))


def _hub_corpus(cfg: DataConfig) -> Corpus:
    from datasets import load_dataset

    try:
        ds = load_dataset(cfg.name, cfg.subset, split=cfg.split)
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else type(exc).__name__
        raise ConfigError(f"data.name={cfg.name}: cannot load the hub data set ({why})") from exc
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field={cfg.text_field!r}: not a column of data.name={cfg.name}; columns: "
                          f"{ds.column_names}")
    digest = hashlib.sha256(f"{cfg.name}:{cfg.subset}:{cfg.split}:{ds._fingerprint}".encode())

    def documents() -> Iterator[str]:  # the prepared Arrow files are memory-mapped: batches, not the column
        return _capped((t for b in ds.select_columns([cfg.text_field]).iter(batch_size=1024)
                        for t in b[cfg.text_field]), cfg)

    return Corpus(documents, digest.hexdigest()[:16], int(ds.data.nbytes))
