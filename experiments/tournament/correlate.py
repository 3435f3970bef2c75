"""Does the template tournament predict training?

    python -m experiments.tournament.correlate \
        --rank experiments/tournament/results/rank.json \
        --compare experiments/tournament/templates_trained.toml \
        --earlier experiments/self_vs_external/results/self_vs_external_summary.json \
        --reuse answer_note=self_answer_note --reuse verifier_feedback=self_feedback \
        --out experiments/tournament/results/tournament_vs_training

Reads the tournament's prediction (`selfopd prompts rank`, no training) and the held-out
changes of the same templates actually trained (`selfopd compare` on
templates_trained.toml: pure self-distillation, 12 steps, three seeds), and reports the
Spearman rank correlation between the predicted order and the change pooled over seeds,
with

- an exact permutation p-value (every order of the templates equally likely under "no
  relation"; with 4 templates the smallest one-sided p is 1/24 = 0.042);
- the correlation under each training seed on its own (does the order hold seed by seed?);
- a parametric bootstrap interval: each arm's pooled change drawn from a normal with the
  spread of its own 95% interval (prompts and seeds), the arms independently (they share
  prompts, so this is wider than a paired resampling would be); the prediction is fixed.

`--reuse ARM=EARLIER_ARM` takes an arm's seeds that are missing here from an earlier
comparison's summary.json that trained the very same configuration, after checking that
the seed both hold gave the same change (runs here are deterministic: every step is
re-seeded). Every tournament measure is correlated too, but only the pre-registered
predicted order is the claim; the others are exploratory (several measures, four points).
Writes OUT.json and OUT.png; prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from selfopd.core.atomic import write_json_atomic
from selfopd.comparisons.compare import load_compare_config
from selfopd.comparisons.compare_report import measure_seed_run
from selfopd.config import load_config
from selfopd.core.plots import new_figure, save_figure
from selfopd.core.run_folder import RunFolder
from selfopd.core.stats import pooled_change

BOOTSTRAP_DRAWS = 20000


@dataclass(frozen=True)
class TrainedTemplate:
    """One arm of the comparison: the template it trained with and its held-out changes."""

    arm: str
    template: str
    change: float  # pooled over seeds, each distinct held-out prompt once
    low: float  # its 95% interval over prompts and seeds
    high: float
    per_seed: dict[int, float]  # each seed's mean change
    source: str  # where the seeds' numbers come from


def trained_templates(compare_path: Path, earlier: dict | None = None,
                      reuse: dict[str, str] | None = None) -> list[TrainedTemplate]:
    """Every arm with a finished run: pooled over the seeds its run folders hold, or (for arms
    in `reuse`) completed from an earlier comparison's summary of the same configuration."""
    compare = load_compare_config(compare_path)
    arms = earlier.get("arms", []) if isinstance(earlier, dict) else (earlier or [])  # summary.json: a list of arms
    earlier_arms = {arm["name"]: arm for arm in arms}
    found = []
    for arm in compare.arms:
        runs = [run for run in (measure_seed_run(compare.arm_dir(arm.name, seed), seed) for seed in compare.seeds)
                if run and run.finished]
        if not runs:
            continue
        config = load_config(RunFolder(compare.arm_dir(arm.name, runs[0].seed)).config)
        here = {run.seed: run.vs_base.mean for run in runs}
        name = (reuse or {}).get(arm.name)
        if name is None or len(runs) == len(compare.seeds):  # pooled over the seeds this comparison holds
            pooled = pooled_change([(r.base, r.final) for r in runs])
            found.append(TrainedTemplate(arm.name, config.teacher.template, pooled.mean, pooled.low, pooled.high,
                                         here, f"this comparison, seeds {sorted(here)}"))
            continue
        if name not in earlier_arms:
            raise SystemExit(f"--reuse {arm.name}={name}: no arm {name!r} in the earlier summary")
        old = earlier_arms[name]
        old_seeds = {run["seed"]: run["vs_base"]["mean"] for run in old["per_seed"]}
        for seed, value in here.items():
            if seed in old_seeds and abs(old_seeds[seed] - value) > 1e-9:
                raise SystemExit(f"--reuse {arm.name}={name}: seed {seed} gave {value:+.4f} here but "
                                 f"{old_seeds[seed]:+.4f} there: not the same configuration")
        if set(old_seeds) != set(compare.seeds):
            raise SystemExit(f"--reuse {arm.name}={name}: the earlier arm has seeds {sorted(old_seeds)}, "
                             f"not {list(compare.seeds)}")
        pooled = old["vs_base"]
        found.append(TrainedTemplate(arm.name, config.teacher.template, pooled["mean"], pooled["low"], pooled["high"],
                                     old_seeds, f"earlier comparison's {name} (seeds {sorted(here)} reproduced here)"))
    return found


def read_prediction(rank_path: Path) -> dict[str, dict[str, float]]:
    """template -> {"predicted_rank": ..., measure: point estimate, ...} from rank.json."""
    rank = json.loads(rank_path.read_text())
    measures = {"teacher_prefers_correct": ("teacher_prefers_correct", "value"), "gap": ("gap", "gap", "mean"),
                "illusion_score": ("illusion", "share", "value"), "teachability": ("teachability", "value"),
                "contrastive_gain": ("contrastive_gain_per_token", "value"),
                "mean_advantage": ("mean_advantage_per_token", "value")}
    out = {}
    for row in rank["ranked"]:
        values = {"predicted_rank": float(row["rank"])}
        for name, path in measures.items():
            value = row
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                values[name] = float(value)
        out[row["template"]] = values
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    if len(set(x.tolist())) < 2 or len(set(y.tolist())) < 2:
        return math.nan
    return float(spearmanr(x, y).statistic)


def permutation_p(x: np.ndarray, y: np.ndarray) -> float:
    """One-sided exact p: the share of all orders of y whose correlation with x is at least
    the observed one."""
    observed = spearman(x, y)
    orders = list(itertools.permutations(range(len(y))))
    return sum(spearman(x, y[list(order)]) >= observed - 1e-12 for order in orders) / len(orders)


def bootstrap_spearman(score: np.ndarray, trained: list[TrainedTemplate], seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of Spearman(score, change) when each arm's pooled change is
    drawn from a normal with the spread of its own 95% interval."""
    rng = np.random.default_rng(seed)
    means = np.array([t.change for t in trained])
    spreads = np.array([(t.high - t.low) / (2 * 1.96) for t in trained])
    values = [spearman(score, rng.normal(means, spreads)) for _ in range(BOOTSTRAP_DRAWS)]
    values = [v for v in values if not math.isnan(v)]
    return (float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))) if values else (math.nan, math.nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=Path, required=True, help="rank.json of selfopd prompts rank")
    parser.add_argument("--compare", type=Path, required=True, help="the comparison file of the trained templates")
    parser.add_argument("--earlier", type=Path, help="an earlier comparison's summary.json, for --reuse")
    parser.add_argument("--reuse", action="append", default=[], metavar="ARM=EARLIER_ARM",
                        help="complete ARM's missing seeds from EARLIER_ARM of --earlier (same configuration)")
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.png are written")
    args = parser.parse_args()

    prediction = read_prediction(args.rank)
    earlier = json.loads(args.earlier.read_text()) if args.earlier else None
    reuse = dict(item.split("=", 1) for item in args.reuse)
    trained = [t for t in trained_templates(args.compare, earlier, reuse) if t.template in prediction]
    if len(trained) < 3:
        raise SystemExit(f"only {len(trained)} trained templates are also in {args.rank}: need at least 3")
    seeds = sorted(set.intersection(*(set(t.per_seed) for t in trained)))
    changes = np.array([t.change for t in trained])
    # Rank 1 is the best predicted: a higher predicted score is a smaller rank number.
    predicted = -np.array([prediction[t.template]["predicted_rank"] for t in trained])
    result = {
        "n_templates": len(trained),
        "held_out": "the demo's 200 distinct held-out prompts, none trained on, paired by prompt",
        "seeds": seeds,
        "templates": [{
            "arm": t.arm, "template": t.template, "predicted_rank": prediction[t.template]["predicted_rank"],
            "held_out_change": {"estimate": t.change, "low": t.low, "high": t.high},
            "per_seed_change": t.per_seed, "source": t.source, "tournament": prediction[t.template],
        } for t in trained],
        "predicted_order": _correlation(predicted, changes, trained, seeds),
        "exploratory": {},
    }
    measures = sorted(set.intersection(*(set(prediction[t.template]) for t in trained)) - {"predicted_rank"})
    for measure in measures:
        score = np.array([prediction[t.template][measure] for t in trained])
        result["exploratory"][measure] = _correlation(score, changes, trained, seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out.with_suffix(".json"), result)
    _plot(trained, prediction, result, args.out.with_suffix(".png"))
    _print(result)


def _correlation(score: np.ndarray, changes: np.ndarray, trained: list[TrainedTemplate], seeds: list[int]) -> dict:
    return {
        "spearman": spearman(score, changes),
        "permutation_p_one_sided": permutation_p(score, changes),
        "bootstrap_95": list(bootstrap_spearman(score, trained)),
        "per_seed_spearman": {seed: spearman(score, np.array([t.per_seed[seed] for t in trained])) for seed in seeds},
    }


def _plot(trained: list[TrainedTemplate], prediction: dict, result: dict, path: Path) -> None:
    figure = new_figure(1, "")
    axes = figure.axes[0]
    for t in trained:
        rank = prediction[t.template]["predicted_rank"]
        axes.errorbar([rank], [t.change], yerr=[[t.change - t.low], [t.high - t.change]], fmt="o", capsize=4)
        axes.scatter([rank] * len(t.per_seed), list(t.per_seed.values()), marker="x", color="grey", zorder=3)
        axes.annotate(t.template.removeprefix("teacher/"), (rank, t.change), textcoords="offset points",
                      xytext=(8, 4), fontsize=8)
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xlabel("tournament's predicted rank (1 = best), before any training")
    axes.set_ylabel("held-out change after 12 steps [95% CI]; x: each seed")
    order = result["predicted_order"]
    axes.set_title(f"Spearman {order['spearman']:+.2f} (bootstrap [{order['bootstrap_95'][0]:+.2f}, "
                   f"{order['bootstrap_95'][1]:+.2f}]), permutation p = {order['permutation_p_one_sided']:.3f}",
                   fontsize=9)
    axes.invert_xaxis()
    save_figure(figure, path)


def _print(result: dict) -> None:
    print(f"{result['n_templates']} templates; {result['held_out']}; seeds {result['seeds']}")
    print(f"{'template':28} {'predicted rank':>14}  {'held-out change [95% CI]':26}  per seed")
    for row in sorted(result["templates"], key=lambda r: r["predicted_rank"]):
        c = row["held_out_change"]
        per_seed = ", ".join(f"{v:+.3f}" for v in row["per_seed_change"].values())
        print(f"{row['template']:28} {row['predicted_rank']:>14g}  {c['estimate']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"
              f"      {per_seed}")
    for name, row in [("predicted order (pre-registered)", result["predicted_order"])] + [
            (f"exploratory: {k}", v) for k, v in result["exploratory"].items()]:
        per_seed = ", ".join(f"{v:+.2f}" for v in row["per_seed_spearman"].values())
        print(f"{name}: Spearman {row['spearman']:+.3f}, bootstrap 95% [{row['bootstrap_95'][0]:+.3f}, "
              f"{row['bootstrap_95'][1]:+.3f}], one-sided permutation p {row['permutation_p_one_sided']:.3f}; "
              f"per seed {per_seed}")


if __name__ == "__main__":
    main()
