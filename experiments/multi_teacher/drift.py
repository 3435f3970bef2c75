"""Secondary measure 4 of PREREGISTRATION.md: each finished run's drift from the start model.

    python -m experiments.multi_teacher.drift      # after `selfopd compare experiments/multi_teacher/compare.toml`

For every finished run whose weights are still on disk and that has no drift yet: `selfopd drift`
(KL(trained || start) per token on the 48 general prompts shipped with selfopd) into RUN/drift,
then the run's records, the drift included, are kept again in results/multi_teacher_runs.tar.xz.
"""

from __future__ import annotations

import subprocess
import sys

from experiments.multi_teacher.report import ARCHIVE, HERE, finished_seeds
from selfopd.comparisons.compare import load_compare_config
from selfopd.comparisons.records import keep_run
from selfopd.core.run_folder import RunFolder


def main() -> None:
    config = load_compare_config(HERE / "compare.toml")
    for arm in (a.name for a in config.arms):
        for seed in finished_seeds(config, arm):
            run_dir = config.arm_dir(arm, seed)
            if (run_dir / "drift" / "summary.json").is_file():
                continue
            if RunFolder(run_dir).latest_checkpoint() is None:
                print(f"{run_dir}: no weights on disk, its drift cannot be measured here")
                continue
            subprocess.run([sys.executable, "-m", "selfopd", "drift", "--run", str(run_dir),
                            "--out", str(run_dir / "drift")], check=True)
            print(f"kept {keep_run(config, run_dir, ARCHIVE / config.name)}")


if __name__ == "__main__":
    main()
