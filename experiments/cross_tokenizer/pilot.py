"""The warm-start pilot (PREREGISTRATION.md, amendment 1), on the study's training split only.

    python -m experiments.cross_tokenizer.pilot 600:2 300:2     # PRETRAIN_STEPS:SFT_EPOCHS ...

The study's 3800 training items are written to a JSONL file; `selfopd sft` splits 200 of them off
as its "held out", so every accuracy printed here is on training-split prompts that the warm start
did not train on. The study's own 200 held-out prompts are not in that file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from selfopd.config import load_config
from selfopd.data import load_examples
from selfopd.data.split import split_examples

ROOT = Path(__file__).resolve().parents[2]
STUDENT_SFT = ROOT / "experiments" / "cross_tokenizer" / "student_sft.toml"
OUT = ROOT / "runs" / "cross_tokenizer" / "pilot"


def training_split_file() -> Path:
    """The study's training items as JSONL (prompt, answer, worked solution)."""
    data = load_config(STUDENT_SFT).data
    train, held_out = split_examples(load_examples(data.spec), eval_size=data.eval_size, seed=data.split_seed)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer, "solution": e.solution}) + "\n"
                            for e in train))
    return path


def pilot(steps: int, epochs: int, train_file: Path) -> list[str]:
    """Pretrain `steps`, warm-start `epochs`; the SFT report's accuracy lines."""
    base = OUT / f"base{steps}"
    if not (base / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "experiments.cross_tokenizer.build_student", str(base),
                        "--steps", str(steps)], check=True, capture_output=True)
    result = subprocess.run([sys.executable, "-m", "selfopd", "sft", str(STUDENT_SFT),
                             "--set", f"model.student={base}", "--set", f"sft.epochs={epochs}",
                             "--set", f"data.spec={train_file}?solution=solution", "--set", f"run.out_dir={OUT}",
                             "--set", f"sft.name=sft_{steps}_{epochs}"], check=True, capture_output=True, text=True)
    return [line.strip() for line in result.stdout.splitlines() if line.strip().startswith(("base ", "tuned "))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", help="PRETRAIN_STEPS:SFT_EPOCHS")
    args = parser.parse_args()
    train_file = training_split_file()
    for setting in args.settings:
        steps, epochs = map(int, setting.split(":"))
        print(f"pretrain {steps} steps, SFT {epochs} epochs:", "; ".join(pilot(steps, epochs, train_file)), flush=True)


if __name__ == "__main__":
    main()
