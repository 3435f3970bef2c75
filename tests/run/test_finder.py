"""selfopd.run.finder: which runs under runs/ saved episodes, for the notebooks."""

from __future__ import annotations

import json
import os

from selfopd.run.finder import newest_episode_run, saves_episodes


def make_run(root, name: str, first_line: str | None, logged_at: int):
    run = root / name
    (run / "rollouts").mkdir(parents=True)
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    os.utime(run / "metrics.jsonl", (logged_at, logged_at))
    if first_line is not None:
        (run / "rollouts" / "step_00001.jsonl").write_text(first_line + "\n")
    return run


def test_the_newest_run_whose_rollouts_are_episodes_is_found_and_others_are_passed_over(tmp_path):
    episode = {"id": "a", "loss_mask": [True, False, True]}
    older = make_run(tmp_path, "older", json.dumps(episode), 100)
    newer = make_run(tmp_path, "newer", json.dumps(episode), 200)
    single = make_run(tmp_path, "single", json.dumps({"id": "a"}), 300)  # no loss_mask: one answer per rollout
    damaged = make_run(tmp_path, "damaged", "{not json", 400)
    unsaved = make_run(tmp_path, "unsaved", None, 500)
    assert [saves_episodes(run) for run in (older, newer, single, damaged, unsaved)] == [True, True, False, False, False]
    assert newest_episode_run(tmp_path) == newer
    assert newest_episode_run(tmp_path / "nothing") is None
