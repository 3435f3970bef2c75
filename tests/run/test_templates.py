"""A run keeps the texts of its templates (RUN/templates/): editing a template file later
does not change what the run's diagnosis, a notebook or a resumed run renders for it."""

from __future__ import annotations

import json

import pytest

from selfopd.cli import main
from selfopd.data.example import Example
from selfopd.run.templates import load_run_template, save_run_templates
from selfopd.templating.templates import TemplateError, load_template, render_teacher

EXAMPLE = Example(id="q1", prompt="What is 2 + 3?", answer="5")
STUDENT = [{"role": "user", "content": EXAMPLE.prompt}]


def _teacher_text(template) -> str:
    return render_teacher(template, EXAMPLE, STUDENT)[-1]["content"]


def test_a_kept_template_renders_as_it_was_with_its_includes(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "part.jinja").write_text("Hint: the answer is {{ answer }}.")
    (mine / "teacher.jinja").write_text('{{ prompt }}\n{% include "part.jinja" %}\n{% include "teacher/empty.jinja" %}')
    names = [str(mine / "teacher.jinja"), "teacher/answer_note"]
    before = {name: _teacher_text(load_template(name)) for name in names}
    kept = tmp_path / "run" / "templates"
    save_run_templates(kept, names)

    (mine / "part.jinja").write_text("Hint: {{ secret }}")  # edited after the run: would now fail
    (mine / "teacher.jinja").write_text("changed")
    for name in names:
        template = load_run_template(tmp_path / "run", name)
        assert _teacher_text(template) == before[name]
        assert template.name == load_template(name).name if name.startswith("teacher/") else template.name == str(
            (mine / "teacher.jinja").resolve())
    assert _teacher_text(load_template(names[0])) == "changed"
    index = json.loads((kept / "index.json").read_text())
    assert index[names[0]]["file"] == "local/teacher.jinja" and (kept / "local" / "part.jinja").is_file()
    assert (kept / "teacher" / "answer_note.jinja").read_text() == load_template("teacher/answer_note").path.read_text()

    # Saving again (a resumed run) keeps the first texts; a new name is added.
    save_run_templates(kept, [*names, "teacher/hints"])
    assert _teacher_text(load_run_template(tmp_path / "run", names[0])) == before[names[0]]
    assert "teacher/hints" in json.loads((kept / "index.json").read_text())


def test_a_run_without_kept_templates_reads_the_current_files(tmp_path):
    assert _teacher_text(load_run_template(tmp_path, "teacher/answer_note")) == _teacher_text(
        load_template("teacher/answer_note"))


@pytest.mark.slow
def test_a_run_keeps_its_templates_and_diagnose_uses_them(tmp_path, tiny_model_dir):
    from selfopd.diagnostics.report import measure_run

    template = tmp_path / "note.jinja"
    template.write_text("{{ prompt }}\n(Note: the answer is {{ answer }}.)")
    sets = ["data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=40&seed=2", "data.eval_size=4",
            f"model.student={tiny_model_dir}", f"teacher.template={template}", "run.steps=1", "run.name=kept",
            f"run.out_dir={tmp_path / 'runs'}", "run.eval_every=0", "run.progress=false", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_tokens=6", "eval.max_tokens=6", "eval.batch_size=4"]
    (tmp_path / "run.toml").write_text("")
    assert main(["train", str(tmp_path / "run.toml"), *[a for s in sets for a in ("--set", s)]]) == 0
    run_dir = tmp_path / "runs" / "kept"
    kept = json.loads((run_dir / "templates" / "index.json").read_text())
    assert set(kept) == {"student/plain", str(template), "teacher/empty"}
    assert (run_dir / "templates" / "local" / "note.jinja").read_text() == template.read_text()

    template.write_text("{{ prompt }} {{ no_such_variable }}")  # the file changes after the run
    diagnosis = measure_run(run_dir, with_model=True, gap_items=2, progress=False)
    assert diagnosis.model_part is not None and diagnosis.annotated


def _kept_run(tmp_path):
    """A run folder that kept teacher/answer_note, and a secret beside the run."""
    run = tmp_path / "run"
    save_run_templates(run / "templates", ["teacher/answer_note"])
    (tmp_path / "secret.jinja").write_text("SECRET {{ answer }}")
    return run


def _point_index_at(run, entry) -> None:
    path = run / "templates" / "index.json"
    path.write_text(json.dumps({"teacher/answer_note": entry}))


@pytest.mark.parametrize("file", ["{tmp}/secret.jinja", "../../secret.jinja", "teacher/../../../secret.jinja",
                                  "link.jinja", "..\\\\..\\\\secret.jinja"])
def test_a_kept_template_outside_the_run_folder_is_refused(tmp_path, file):
    run = _kept_run(tmp_path)
    (run / "templates" / "link.jinja").symlink_to(tmp_path / "secret.jinja")
    file = file.format(tmp=tmp_path)
    _point_index_at(run, {"file": file, "name": "teacher/answer_note"})
    with pytest.raises(TemplateError) as error:
        load_run_template(run, "teacher/answer_note")
    assert str(error.value) == (f"{run}/templates/index.json: entry 'teacher/answer_note': file {file!r} leads outside "
                                f"{run}/templates; a run folder's templates must lie inside its templates/ folder")


@pytest.mark.parametrize("index, expected", [
    ('{"teacher/answer_note": "teacher/answer_note.jinja"}', r"index\.json: entry 'teacher/answer_note': expected \{\"file\""),
    ('{"teacher/answer_note": {"file": 3, "name": "x"}}', r"index\.json: entry 'teacher/answer_note': expected \{\"file\""),
    ('{"teacher/answer_note": {"file": "teacher/answer_note.jinja", "name": "x\\u001b[2J"}}',
     r"index\.json: entry 'teacher/answer_note': expected \{\"file\""),
    ('["teacher/answer_note"]', r"index\.json: expected a JSON object of templates, got list"),
    ('{"teacher/answer_note": ', r"index\.json: not a readable JSON index of templates: "),
    (b'\xff\xfe{}', r"index\.json: not a readable JSON index of templates: "),
])
def test_a_garbled_index_is_one_line_naming_it(tmp_path, index, expected):
    run = _kept_run(tmp_path)
    path = run / "templates" / "index.json"
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    with pytest.raises(TemplateError, match=rf"^{run}/templates/{expected}") as error:
        load_run_template(run, "teacher/answer_note")
    assert "\n" not in str(error.value)


def test_a_kept_template_includes_only_templates_of_the_run_folder(tmp_path):
    """A copy in the run folder that includes a file beside it (not a template) is refused."""
    run = _kept_run(tmp_path)
    (run / "templates" / "teacher" / "answer_note.jinja").write_text("{{ prompt }}{% include 'notes.txt' %}")
    (run / "templates" / "teacher" / "notes.txt").write_text("SECRET")
    with pytest.raises(TemplateError, match=r"answer_note\.jinja:1: template 'notes\.txt' refused: not a \.jinja"):
        _teacher_text(load_run_template(run, "teacher/answer_note"))


def test_a_resumed_run_does_not_write_its_templates_through_a_planted_link(tmp_path):
    run = _kept_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "templates" / "local").symlink_to(elsewhere)
    (tmp_path / "sub").mkdir()
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ prompt }}{% include 'sub/part.jinja' %}")  # kept as local/sub/part.jinja
    (tmp_path / "sub" / "part.jinja").write_text("!")
    with pytest.raises(TemplateError, match=rf"^{run}/templates/local: leads outside {run}/templates"):
        save_run_templates(run / "templates", ["teacher/answer_note", str(mine)])
    assert list(elsewhere.iterdir()) == []


def test_the_run_keeps_the_eval_template_when_it_is_not_the_students():
    from selfopd.config import load_config
    from selfopd.run.templates import config_template_names

    assert config_template_names(load_config(None)) == ["student/plain", "teacher/reference_answer", "teacher/empty"]
    config = load_config(None, ["data.student_template=student/opsd", "eval.student_template=student/opsd_eval"])
    assert config_template_names(config)[:2] == ["student/opsd", "student/opsd_eval"]
