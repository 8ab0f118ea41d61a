"""Raw documents for each ``data.source``, with a fingerprint that keys the token cache."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ddptrain.choices import DataFormat
from ddptrain.config import DataConfig
from ddptrain.errors import ConfigError, flat

READS = {  # the sources each data.format can read; instructions: prompt/completion pairs generated locally
    DataFormat.packed: ("stdlib_code", "synthetic", "files", "hub"),
    DataFormat.prompt_completion: ("files", "hub", "instructions"),
}
FILE_LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


@dataclass
class Corpus:
    documents: list[str]
    fingerprint: str  # changes whenever the documents could have changed


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
    """The standard library's own .py sources on this machine, tests excluded, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files)


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.source == "stdlib_code":
        return _stdlib_corpus(cfg)
    if cfg.source == "files":
        return _files_corpus(cfg)
    if cfg.source == "hub":
        return _hub_corpus(cfg)
    raise ConfigError(f"data.source={cfg.source!r} has no documents")


def _stdlib_corpus(cfg: DataConfig) -> Corpus:
    files = stdlib_files()[: cfg.max_documents]
    if not files:
        raise ConfigError(f"data.source=stdlib_code: no .py files under {sysconfig.get_paths()['stdlib']}")
    digest = hashlib.sha256()
    docs = []
    for path in files:
        data = path.read_bytes()
        digest.update(f"{path.name}:{len(data)}".encode())
        docs.append(data.decode("utf-8", errors="replace"))
    return Corpus(docs, digest.hexdigest()[:16])


def _files_corpus(cfg: DataConfig) -> Corpus:
    from datasets import load_dataset

    kind = FILE_LOADERS[Path(cfg.paths[0]).suffix.lower()]
    extra = {"sample_by": "document"} if kind == "text" else {}
    try:
        ds = load_dataset(kind, data_files=[str(Path(p).absolute()) for p in cfg.paths], split="train", **extra)
    except Exception as exc:
        raise ConfigError(f"data.paths: cannot read as {kind}: {flat(str(exc), 200)}") from exc
    digest = hashlib.sha256()
    for p in cfg.paths:
        st = Path(p).stat()
        digest.update(f"{Path(p).absolute()}:{st.st_size}:{st.st_mtime_ns}:{cfg.text_field}".encode())
    return Corpus(_text_column(ds, cfg, f"data.paths ({', '.join(cfg.paths)})"), digest.hexdigest()[:16])


def _hub_corpus(cfg: DataConfig) -> Corpus:
    from datasets import load_dataset

    try:
        ds = load_dataset(cfg.name, cfg.subset, split=cfg.split)
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else type(exc).__name__
        raise ConfigError(f"data.name={cfg.name}: cannot load the hub data set ({why})") from exc
    digest = hashlib.sha256(f"{cfg.name}:{cfg.subset}:{cfg.split}:{ds._fingerprint}".encode())
    return Corpus(_text_column(ds, cfg, f"data.name={cfg.name}"), digest.hexdigest()[:16])


def _text_column(ds, cfg: DataConfig, what: str) -> list[str]:
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field={cfg.text_field!r}: not a column of {what}; columns: {ds.column_names}")
    docs = [t for t in ds[cfg.text_field][: cfg.max_documents] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ConfigError(f"{what}: no non-empty text in column {cfg.text_field!r}")
    return docs
