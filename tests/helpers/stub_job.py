"""A stand-in for one sweep job's ``python -m ddptrain`` (standard library only, well under a second): it reads
the job's overrides and writes the ``summary.json`` a run would, with figures that are functions of them, so the
sweep machinery (Hydra's sweepers, ddptrain's launcher, the report) is tested without training.

    python stub_job.py '<overrides as JSON>' <run dir>

``final_val_loss`` is ``(log10(optim.lr) + 3) ** 2 + 1`` (smallest at lr 1e-3), ``tokens_per_s`` is
``1000 * data.micro_batch_size``. ``data.micro_batch_size=3`` fails as ddptrain does on a bad start-up: one
``ddptrain: error:`` line, exit code 2.
"""

import json
import math
import sys
from pathlib import Path


def main() -> int:
    overrides = dict(o.split("=", 1) for o in json.loads(sys.argv[1]))
    run_dir = Path(sys.argv[2])
    micro = int(overrides.get("data.micro_batch_size", "2"))
    if micro == 3:
        sys.stderr.write("ddptrain: error: data.global_batch_size=2 is not divisible by data.micro_batch_size=3\n")
        return 2
    lr = float(overrides.get("optim.lr", "1e-3"))
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {"final_val_loss": (math.log10(lr) + 3) ** 2 + 1, "tokens_per_s": 1000.0 * micro, "step_time_s": 0.5}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
