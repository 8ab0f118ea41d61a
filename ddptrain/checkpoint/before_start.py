"""What can be known about a run's checkpoints from their files alone, before any worker starts.

The launcher asks it once (``ddptrain/app/before_start.py``), so a run that would be refused is refused in
seconds, with one line, and before anything is written into the run directory. The checks are the workers' own
(``Checkpointer.refuse_overwrite``, ``resolve`` and ``load``), made on the files without a process group or a
built model; the workers still make them, as the authority, and for what only they can see (a tokenizer whose
vocabulary changed, a launcher that is not ddptrain's).

- A fresh run (no ``train.resume``) into a run directory that holds committed checkpoints: refused, unless
  ``checkpoint.overwrite``.
- ``train.resume``: the checkpoint it names (``auto``: the newest intact one here) must be intact (every file's
  size and checksum against its marker) and made for this model. ``model.*`` against the checkpoint's own
  ``config.yaml`` decides that without torch when it can (another architecture, depth or width: refused; every
  shape key equal: accepted); otherwise a model built on the meta device (no memory, no initialisation) must
  have the fingerprint the marker records.
- ``check_resumable``, after the run's first line: the trainer state is plain data and the model state's index
  names no other code (these need torch, seconds to import on a loaded machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddptrain.checkpoint.format import (
    committed,
    find_checkpoint,
    model_fingerprint,
    newest_intact,
    other_model,
    overwrite_refusal,
    read_marker,
    read_trainer_state,
)
from ddptrain.config.choices import Quantize
from ddptrain.config.schema import Config, ModelConfig
from ddptrain.errors import ConfigError, flat

# model.* keys that name the parameters or their shapes; two plain models (no pretrained base, LoRA or 4-bit
# weights) equal in these are built alike. Of them, a different architecture, depth or width always changes
# the state's names or shapes (``CERTAIN``); the others may or may not (heads of the same total width), which a
# model built on the meta device decides.
SHAPE_KEYS = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "max_position_embeddings", "vocab_size", "tie_embeddings")
CERTAIN = ("arch", "hidden_size", "num_layers")


def check_checkpoints(cfg: Config, run_dir: Path) -> Path | None:
    """Refuse (ConfigError, one line) what the run directory's checkpoints and ``train.resume``'s files decide
    without torch: another run's checkpoints, a missing or damaged checkpoint, another architecture. Returns the
    checkpoint the run will resume (None: a fresh start), for ``check_resumable``."""
    root = run_dir / cfg.checkpoint.dir
    target = cfg.train.resume
    found = committed(root)
    if target is None:
        if found and not cfg.checkpoint.overwrite:
            raise ConfigError(overwrite_refusal(root, found[-1]))
        return None
    candidates = found if target == "auto" else [find_checkpoint(Path(target), cfg.checkpoint.dir, "train.resume")]
    # auto skips a damaged newest one for an older intact one, as the workers will (rank 0 moves it aside then)
    chosen, _, problem = newest_intact(candidates)
    if chosen is None:
        if problem:
            raise ConfigError(f"train.resume={target}: {problem}")
        return None
    path = Path(chosen)
    same = same_model(cfg.model, path)
    if same is None:  # model.* changed where only the shapes can tell: build it on the meta device (torch)
        same = same_fingerprint(cfg.model, path)
    if same is False:
        raise ConfigError(other_model(path))
    return path


def same_fingerprint(cfg: ModelConfig, path: Path) -> bool | None:
    """Whether a model built from ``model.*`` has the fingerprint the checkpoint's marker records (None: the
    model is not built from ``model.*`` alone, or the marker records none)."""
    expected = planned_fingerprint(cfg, path)
    recorded = read_marker(path, "train.resume").get("fingerprint")
    return None if expected is None or recorded is None else expected == recorded


def check_resumable(path: Path) -> None:
    """The reads that need torch, made once the run's first line is out: the trainer state is plain data and the
    model state's index names no other code."""
    read_trainer_state(path, "train.resume")
    from ddptrain.checkpoint.safe import SafeReader

    try:
        SafeReader(str(path / "state")).read_metadata()  # refused in one line if it names other code
    except ConfigError:
        raise
    except (OSError, RuntimeError, EOFError, KeyError, ValueError) as exc:
        raise ConfigError(f"train.resume: {path} is corrupt ({flat(str(exc), 160)})") from exc


def same_model(cfg: ModelConfig, checkpoint: Path) -> bool | None:
    """Whether the checkpoint's model (its ``config.yaml``) is this run's, from ``model.*`` alone: True when
    every ``SHAPE_KEYS`` value is equal, False when a ``CERTAIN`` one differs, None when the configs cannot
    tell (a key that may not change a shape, a pretrained base, adapters, 4-bit weights, no readable config)."""
    ours = _plain(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    try:
        saved = _plain(OmegaConf.to_container(OmegaConf.load(checkpoint / "config.yaml")).get("model"))
    except (OSError, ValueError, AttributeError, TypeError):  # not a mapping with model.*, or unreadable
        return None
    if ours is None or saved is None:
        return None
    if any(ours.get(key) != saved.get(key) for key in CERTAIN):
        return False
    return True if all(ours.get(key) == saved.get(key) for key in SHAPE_KEYS) else None


def _plain(model: Any) -> dict[str, Any] | None:
    """``model.*`` as a dict when it describes a model built from these keys alone; None otherwise."""
    if not isinstance(model, dict) or model.get("pretrained") is not None or model.get("quantize", "none") != "none":
        return None
    lora = model.get("lora")
    return None if isinstance(lora, dict) and lora.get("enabled") else model


def planned_fingerprint(cfg: ModelConfig, checkpoint: Path) -> str | None:
    """The fingerprint the worker's model will have, from ``model.*`` and the checkpoint's own vocabulary (its
    ``hf/config.json``; the data's tokenizer, which the worker reads, is not read here); None where the
    model is not built from ``model.*`` alone (a pretrained base, LoRA adapters, 4-bit weights): the workers
    check those once they have the model."""
    if cfg.pretrained is not None or cfg.lora.enabled or cfg.quantize != Quantize.none:
        return None
    try:
        saved = json.loads((checkpoint / "hf" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = cfg.vocab_size or (saved.get("vocab_size") if isinstance(saved, dict) else None)
    if not isinstance(vocab, int) or vocab < 1:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from ddptrain.models.build import hf_config

    with torch.device("meta"):  # names and shapes only: nothing allocated, nothing initialised
        model = AutoModelForCausalLM.from_config(hf_config(cfg, vocab, None), attn_implementation="sdpa")
    return model_fingerprint(model)
