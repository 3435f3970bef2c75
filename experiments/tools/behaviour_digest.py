"""Proof that a refactor changed no behaviour: five short tiny-model runs (GRPO + OPD; top-k
with the cures; the wrong-context baseline; a full-vocabulary frozen teacher; an EMA sibling
teacher), digested as their metrics (timings left out), rollouts and checkpoint bytes.

    git worktree add /tmp/before HEAD~1
    python -m experiments.tools.behaviour_digest --code /tmp/before --out runs/behaviour/before
    python -m experiments.tools.behaviour_digest --out runs/behaviour/after
    python -m experiments.tools.behaviour_digest --compare runs/behaviour/before runs/behaviour/after

About a minute per checkout on a 2-core CPU. `--code` is the checkout whose selfopd runs
(default: this one): the runs happen in a child process of this Python with that checkout first
on PYTHONPATH and the editable install's import hook left out, so `selfopd` and its
`selfopd.verifiers` and `selfopd.prompts` all come from that checkout (the digest records which);
the tiny model is the test suite's (a seeded 2-layer Llama with SmolLM2's tokenizer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from selfopd.run.tracking import untimed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = "rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2"
COMMON = ["data.eval_size=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_tokens=8",
          "optim.micro_batch_prompts=2", "optim.lr=1e-3", "eval.max_tokens=6", "eval.batch_size=4",
          "run.progress=false", "run.eval_every=0", "run.steps=2", "run.rollouts_to_save=8"]
CASES = {
    "grpo_opd": ["loss.lambda_rl=1", "loss.lambda_opd=0.3", "teacher.template=teacher/answer_note"],
    "topk_cures": ["loss.divergence=topk_reverse_kl", "loss.top_k=4", "loss.rlsd_weight=0.5", "loss.lambda_rl=1",
                   "loss.pass_rate_weighting=true", "loss.token_clip=0.5"],
    "wrong_context": ["loss.opd_baseline=wrong_context", "loss.opd_on=failed", "loss.lambda_rl=1",
                      "teacher.template=teacher/answer_note"],
    "full_frozen": ["teacher.kind=frozen", "loss.divergence=reverse_kl", "loss.is_cap=2"],
    "ema_sibling": ["teacher.kind=ema", "teacher.template=teacher/sibling", "rollout.temperature=1.0"],
}


def run_child(code: Path, out: Path, model: Path) -> None:
    """Make `out`/digest.json with `code`'s selfopd: this file run again by this Python, with `code`
    first on PYTHONPATH (see `digest`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--code", str(code), "--out", str(out),
                    "--model", str(model)], env=env, check=True)


def digest(code: Path, out: Path, model: Path) -> dict:
    """The five runs by `code`'s selfopd (in the child process; `code` is first on PYTHONPATH). The
    editable install's import hook is left out, so `selfopd.verifiers` and `selfopd.prompts` come
    from `code`'s own folders too (a checkout older than that mapping gets them from the hook)."""
    hooks = [finder for finder in sys.meta_path if "editable" in repr(finder).lower()]
    sys.meta_path[:] = [finder for finder in sys.meta_path if finder not in hooks]
    import selfopd

    if Path(selfopd.__file__).resolve().parents[1] != code:
        raise SystemExit(f"selfopd comes from {selfopd.__file__}, not from {code}")
    if not hasattr(selfopd, "_SourceTreeFinder"):
        sys.meta_path.extend(hooks)
        print(f"note: {code} does not map its verifiers/ and prompts/: they come from the installed selfopd")
    from transformers import AutoTokenizer

    from selfopd import load_config, resolve_model, train  # the public API: the same in every checkout
    from tests.conftest import save_tiny_llama

    if not model.is_dir():  # one place for both checkouts: its path is written into every checkpoint
        save_tiny_llama(model, AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")), 64, 4, 16)
    result = {}
    for name, sets in CASES.items():
        run = train(load_config(None, [f"data.spec={DATA}", f"model.student={model}", *COMMON, *sets,
                                       f"run.out_dir={out}", f"run.name={name}"]))
        lines = (run / "metrics.jsonl").read_text().splitlines()
        files = sorted(p for p in run.rglob("*") if p.is_file() and {"checkpoints", "rollouts"} & set(p.parts))
        result[name] = {"metrics": [untimed(json.loads(line)) for line in lines],
                        "files": {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                                  for p in files}}
    return result


def compare(before: dict, after: dict) -> list[str]:
    """Every difference, named by run, file or metrics line and key."""
    problems = [f"{name}: only in one digest" for name in set(before) ^ set(after)]
    for name in sorted(set(before) & set(after)):
        a, b = before[name], after[name]
        problems += [f"{name}: {path} differs" for path in sorted(set(a["files"]) | set(b["files"]))
                     if a["files"].get(path) != b["files"].get(path)]
        if len(a["metrics"]) != len(b["metrics"]):
            problems.append(f"{name}: {len(a['metrics'])} vs {len(b['metrics'])} metrics lines")
        for index, (x, y) in enumerate(zip(a["metrics"], b["metrics"])):
            problems += [f"{name}: metrics line {index} {key}: {x.get(key)!r} vs {y.get(key)!r}"
                         for key in sorted(set(x) | set(y)) if x.get(key) != y.get(key)]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "behaviour" / "digest")
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "behaviour" / "tiny-model",
                        help="where the tiny model is saved once (the same for both digests)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="two --out folders")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the runs themselves (run_child)
    args = parser.parse_args()
    if args.child:
        result = digest(args.code, args.out, args.model)
        (args.out / "digest.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        return 0
    if args.compare:
        before, after = (json.loads((folder / "digest.json").read_text()) for folder in args.compare)
        problems = compare(before, after)
        print("\n".join(problems) if problems else f"identical: {', '.join(before)} (metrics, rollouts, checkpoints)")
        return 1 if problems else 0
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty: give a fresh --out")
    args.out.mkdir(parents=True, exist_ok=True)
    run_child(args.code.resolve(), args.out.resolve(), args.model.resolve())
    print(f"wrote {args.out / 'digest.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
