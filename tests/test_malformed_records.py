"""Malformed prompt/completion files: each bad record stops the data build with one line that names the file, where
in it (line of a JSON Lines file, record of a parquet file) and what was expected there; blank lines between
records are fine. ``test_bad_inputs.py`` runs one case through the command on 2 ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddptrain.config.schema import DataConfig
from ddptrain.data import build_token_data, validate_source
from ddptrain.errors import ConfigError

GOOD = [{"prompt": f"What is {a} plus {a}?", "completion": f"{a} plus {a} is {2 * a}."} for a in range(8)]


def _lines(*bad: str, blank_before: int = 0) -> Callable[[Path], None]:
    """Two good records, ``blank_before`` blank lines, the ``bad`` lines (from line 3 + blank_before), six good."""
    def write(path: Path) -> None:
        good = [json.dumps(r) for r in GOOD]
        path.write_text("\n".join([*good[:2], *[""] * blank_before, *bad, *good[2:]]) + "\n")
    return write


def _parquet(prompt: pa.Array, completion: pa.Array, names: tuple[str, str] = ("prompt", "completion")
             ) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        pq.write_table(pa.table({names[0]: prompt, names[1]: completion}), path)
    return write


STRINGS = pa.array([r["prompt"] for r in GOOD])
CASES = [
    ("a.jsonl", _lines(json.dumps({"completion": "x"})),
     "line 3 has no 'prompt' (data.prompt_field); expected a string there; its fields: completion"),
    ("a.jsonl", _lines(json.dumps({"prompt": "x"}), blank_before=2),
     "line 5 has no 'completion' (data.completion_field); expected a string there; its fields: prompt"),
    ("a.jsonl", _lines('{"prompt": "x", "completion": '),
     "line 3 is not JSON (Expecting value); expected JSON Lines, one object per line"),
    ("a.jsonl", _lines(json.dumps({"prompt": "x", "completion": ["y"]})),
     "line 3: 'completion' (data.completion_field) is a list, expected a string"),
    ("a.jsonl", _lines(json.dumps({"prompt": "x", "completion": 7})),
     "line 3: 'completion' (data.completion_field) is a number, expected a string"),
    ("a.jsonl", _lines(json.dumps({"prompt": None, "completion": "y"})),
     "line 3: 'prompt' (data.prompt_field) is null, expected a string"),
    ("a.jsonl", _lines(json.dumps({"prompt": "x", "completion": {"text": "y"}})),
     "line 3: 'completion' (data.completion_field) is an object, expected a string"),
    ("a.jsonl", _lines(json.dumps({"prompt": True, "completion": "y"})),
     "line 3: 'prompt' (data.prompt_field) is a boolean, expected a string"),
    ("a.jsonl", _lines("42"), "line 3 is a number, expected a JSON object per line"),
    ("a.json", _lines(json.dumps(["x", "y"])),
     "line 3 is a list, expected a JSON object per line (JSON Lines, not one JSON array)"),
    ("a.json", lambda path: path.write_text(json.dumps(GOOD, indent=1)),
     "line 1 is not JSON (Expecting value); expected JSON Lines, one object per line"),
    ("a.json", lambda path: path.write_text(json.dumps(GOOD)),
     "line 1 is a list, expected a JSON object per line (JSON Lines, not one JSON array)"),
    ("a.jsonl", lambda path: path.write_bytes(b'{"prompt": "x", "completion": "y"}\n{"prompt": "\xff"}\n'),
     "line 2 is not JSON (not UTF-8 text); expected JSON Lines, one object per line"),
    ("a.parquet", _parquet(STRINGS, pa.array(range(8))),
     "record 1: 'completion' (data.completion_field) is a number, expected a string"),
    ("a.parquet", _parquet(pa.array([*STRINGS.to_pylist()[:4], None, *STRINGS.to_pylist()[5:]]), STRINGS),
     "record 5: 'prompt' (data.prompt_field) is null, expected a string"),
    ("a.parquet", _parquet(STRINGS, pa.array([["y"]] * 8)),
     "record 1: 'completion' (data.completion_field) is a list, expected a string"),
    ("a.parquet", _parquet(STRINGS, STRINGS, names=("question", "completion")),
     "record 1 has no 'prompt' (data.prompt_field); expected a string there; its fields: question, completion"),
]


def _build(tmp_path: Path, name: str, tokenizer: Path) -> None:
    """What a run does with ``data.paths=[name]`` before training: the start-up checks, then the data build."""
    cfg = DataConfig(source="files", paths=[str(tmp_path / name)], format="prompt_completion",
                     tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache"), seq_len=40, val_fraction=0.1)
    validate_source(cfg)
    build_token_data(cfg)


@pytest.mark.parametrize(("name", "write", "message"), CASES, ids=[f"{n}:{m[:48]}" for n, _, m in CASES])
def test_a_malformed_record_stops_with_one_line_naming_the_file_where_and_what_was_expected(
    tmp_path: Path, pretrained_base: Path, name: str, write: Callable[[Path], None], message: str
) -> None:
    write(tmp_path / name)
    with pytest.raises(ConfigError) as raised:
        _build(tmp_path, name, pretrained_base)
    assert str(raised.value) == f"data.paths: {tmp_path / name}: {message}"


def test_a_csv_file_is_refused_in_one_line_before_any_read(tmp_path: Path, pretrained_base: Path) -> None:
    (tmp_path / "a.csv").write_text("prompt,completion\nx,y\n")
    with pytest.raises(ConfigError, match=r"^data\.paths: .*a\.csv: expected one of \.txt, \.jsonl, \.json, "
                                          r"\.parquet files$"):
        _build(tmp_path, "a.csv", pretrained_base)


def test_blank_lines_between_records_are_accepted(tmp_path: Path, pretrained_base: Path) -> None:
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text("\n" + "\n  \n\t\n".join(json.dumps(r) for r in GOOD) + "\n\n")
    dense = tmp_path / "dense.jsonl"
    dense.write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    built = []
    for path in (spaced, dense):
        cfg = DataConfig(source="files", paths=[str(path)], format="prompt_completion", tokenizer=str(pretrained_base),
                         cache_dir=str(tmp_path / "cache"), seq_len=40, val_fraction=0.1)
        data = build_token_data(cfg)
        built.append((data.train["input_ids"], data.val["input_ids"]))
    assert built[0] == built[1] and len(built[0][0]) + len(built[0][1]) == len(GOOD)


ROWS = 1100  # past the first 1,024-row batch the records are read in


def test_a_parquet_record_is_numbered_across_the_files_arrow_batches(tmp_path: Path, pretrained_base: Path) -> None:
    prompts = [f"q{i}" for i in range(ROWS)]
    completions: list[str | None] = [f"a{i}" for i in range(ROWS)]
    completions[ROWS - 1] = None  # record 1100, the 76th of the second batch
    _parquet(pa.array(prompts), pa.array(completions))(tmp_path / "big.parquet")
    with pytest.raises(ConfigError) as raised:
        _build(tmp_path, "big.parquet", pretrained_base)
    assert str(raised.value) == (f"data.paths: {tmp_path / 'big.parquet'}: record 1100: 'completion' "
                                 "(data.completion_field) is null, expected a string")


@pytest.mark.parametrize("bad", [3, ROWS])
def test_a_hub_record_is_numbered_from_one_as_it_is_read(
    tmp_path: Path, pretrained_base: Path, monkeypatch: pytest.MonkeyPatch, bad: int
) -> None:
    """A hub data set (here an in-memory one in place of the download) read in batches: the bad record's number
    counts every record before it, across batches, from 1."""
    completions: list[str | None] = [f"a{i}" for i in range(ROWS)]
    completions[bad - 1] = None
    loaded = datasets.Dataset.from_dict({"prompt": [f"q{i}" for i in range(ROWS)], "completion": completions})
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: loaded)
    cfg = DataConfig(source="hub", name="someone/pairs", format="prompt_completion", tokenizer=str(pretrained_base),
                     cache_dir=str(tmp_path / "cache"), seq_len=40, val_fraction=0.1)
    with pytest.raises(ConfigError) as raised:
        build_token_data(cfg)
    assert str(raised.value) == (f"data.name=someone/pairs: record {bad}: 'completion' (data.completion_field) is "
                                 "null, expected a string")
