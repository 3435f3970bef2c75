"""What a finished `selfopd sft` run says about itself: summary.json, its README.md and the
headline it prints (held-out accuracy before and after, paired over distinct prompts)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from selfopd.core.run_folder import portable_path
from selfopd.comparisons.sft_targets import Target, TargetStats

NLL_PROBE_SIZE = 64  # training targets whose NLL is reported before and after training


def sft_summary(student: str, data: str, batch_size: int, model_dir: Path, kind: str, stats: TargetStats,
                targets: Sequence[Target], losses: list[float], nll_before: float, nll_after: float, base: Any,
                base_records: Sequence[Any], tuned: Any, tuned_records: Sequence[Any],
                seconds: dict[str, float]) -> dict[str, Any]:
    from selfopd.run.evaluate import outcomes_by_prompt
    from selfopd.core.stats import paired_change

    difference = paired_change(outcomes_by_prompt(base_records), outcomes_by_prompt(tuned_records))
    steps_per_epoch = -(-len(targets) // batch_size)
    return {
        "student": student,
        "data": data,
        "targets": kind,
        "target_counts": dataclasses.asdict(stats),
        "train_pairs": len(targets),
        "train_tokens": sum(len(t.completion_ids) for t in targets),
        "steps": len(losses),
        "loss_first_epoch": sum(losses[:steps_per_epoch]) / max(len(losses[:steps_per_epoch]), 1),
        "loss_last_epoch": sum(losses[-steps_per_epoch:]) / max(len(losses[-steps_per_epoch:]), 1),
        "train_nll_targets": min(len(targets), NLL_PROBE_SIZE),
        "train_nll_before": nll_before,
        "train_nll_after": nll_after,
        "eval_n": base.n,
        "base": {"accuracy": base.value, "ci95": [base.low, base.high]},
        "tuned": {"accuracy": tuned.value, "ci95": [tuned.low, tuned.high]},
        "paired_difference": {"mean": difference.mean, "ci95": [difference.low, difference.high]},
        "seconds": seconds,
        "model": portable_path(model_dir),
    }


def _verdict(summary: dict[str, Any]) -> str:
    low, high = summary["paired_difference"]["ci95"]
    if low > 0:
        return "a gain (95% interval above zero)"
    if high < 0:
        return "a LOSS (95% interval below zero)"
    return "no significant change (95% interval contains zero)"


def sft_headline(summary: dict[str, Any]) -> str:
    base, tuned, diff = summary["base"], summary["tuned"], summary["paired_difference"]
    return "\n".join([
        f"held-out greedy accuracy over {summary['eval_n']} distinct prompts, none trained on:",
        f"  base   {base['accuracy']:.3f} [{base['ci95'][0]:.3f}, {base['ci95'][1]:.3f}]",
        f"  tuned  {tuned['accuracy']:.3f} [{tuned['ci95'][0]:.3f}, {tuned['ci95'][1]:.3f}]",
        f"  change {diff['mean']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}] (paired): {_verdict(summary)}",
        f"  {summary['train_pairs']} {summary['targets']} targets, {summary['steps']} steps, "
        f"{summary['seconds']['total'] / 60:.1f} min",
    ])


def dropped_targets(counts: dict[str, Any]) -> str:
    """What became of the candidate targets, in words."""
    if counts["kind"] == "solution":
        return (f"{counts['kept']} of {counts['items']} worked solutions kept (final answer appended to "
                f"{counts['fixed']}; {counts['wrong']} still unverified, {counts['unfinished']} too long)")
    return (f"{counts['kept']} kept of {counts['drawn']} answers drawn for {counts['items']} training items "
            f"(wrong {counts['wrong']}, unfinished {counts['unfinished']}, duplicate {counts['duplicate']})")


def sft_report(summary: dict[str, Any]) -> str:
    counts = summary["target_counts"]
    return f"""# SFT teacher: {summary['student']} fine-tuned on {summary['targets']} targets

Data: `{summary['data']}`

```
{sft_headline(summary)}
```

Targets: {dropped_targets(counts)}; {summary['train_tokens']} completion tokens.
NLL per token of {summary['train_nll_targets']} training targets: {summary['train_nll_before']:.3f} -> \
{summary['train_nll_after']:.3f}.

Files: `config.toml` (the config), `targets.jsonl` (what was trained on), `eval/base/` and
`eval/tuned/` (per-item held-out answers), `summary.json`, `model/` (HF weights + tokenizer).

Use it as the external teacher of an OPD run (it shares the student's tokenizer):

    selfopd train experiments/demo/demo.toml --set teacher.kind=external --set teacher.model={summary['model']} \\
        --set teacher.template=teacher/empty

(`teacher/empty`: the tuned model scores the student's tokens after the student's own prompt;
a privileged template works as well.)
"""
