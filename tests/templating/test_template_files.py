"""selfopd.templating.template_files: a template pulls in only .jinja templates of its own folder and
of prompts/, and every template file is UTF-8 text of a bounded size."""

from __future__ import annotations

import pytest

from selfopd.templating.templates import TemplateError, load_template

SECRET = "sk-live-not-for-prompts"


def _render(path) -> str:
    return load_template(path).render({"prompt": "What is 2 + 2?"})[-1]["content"]


@pytest.fixture
def folder(tmp_path):
    """A user's folder of templates, a secret beside them, and a secret one level up."""
    mine = tmp_path / "mine"
    (mine / "parts").mkdir(parents=True)
    (mine / "secret.txt").write_text(SECRET)
    (mine / "secret").write_text(SECRET)
    (tmp_path / "outside.jinja").write_text(SECRET)
    (mine / "parts" / "note.jinja").write_text("(note)")
    return mine


@pytest.mark.parametrize("name, reason", [
    ("secret.txt", "not a .jinja template"),
    ("secret", "not a .jinja template"),
    ("../outside.jinja", "a path with '..'"),
    ("parts/../../outside.jinja", "a path with '..'"),
    ("{folder}/../outside.jinja", "an absolute path"),
    ("/etc/passwd", "an absolute path"),
    ("..\\\\outside.jinja", "a name with a backslash"),
])
@pytest.mark.parametrize("statement", ["include '{}'", "extends '{}'", "import '{}' as x", "from '{}' import x"])
def test_only_jinja_templates_inside_the_folders_are_reachable(folder, name, reason, statement):
    name = name.format(folder=folder)
    path = folder / "t.jinja"
    path.write_text("{{ prompt }}\n{% " + statement.format(name) + " %}\n")
    with pytest.raises(TemplateError) as error:
        _render(path)
    message = str(error.value)
    shown = name.replace("\\\\", "\\")  # the template's string literal '..\\\\x' is the name '..\\x'
    assert message.startswith(f"{path}:2: template {shown!r} refused: {reason}"), message
    assert "\n" not in message and SECRET not in message


def test_a_link_leading_out_of_the_folder_is_refused(folder):
    (folder / "link.jinja").symlink_to(folder.parent / "outside.jinja")
    (folder / "text.jinja").symlink_to(folder / "secret.txt")  # inside, but not a template
    for link in ("link.jinja", "text.jinja"):
        path = folder / "t.jinja"
        path.write_text("{{ prompt }}{% include '" + link + "' %}")
        with pytest.raises(TemplateError, match=rf"t\.jinja:1: template '{link}' refused: a link leading out of "):
            _render(path)


def test_templates_of_the_folder_its_subfolders_and_prompts_are_reachable(folder):
    (folder / "same.jinja").symlink_to(folder / "parts" / "note.jinja")  # a link that stays inside
    path = folder / "t.jinja"
    path.write_text("{{ prompt }} {% include 'parts/note.jinja' %} {% include 'same.jinja' %}\n"
                    "{% include 'student/plain.jinja' %}")
    assert _render(path) == "What is 2 + 2? (note) (note)What is 2 + 2?"  # trim_blocks eats the newline


def test_a_template_file_that_is_not_utf8_is_one_line(folder):
    path = folder / "latin1.jinja"
    path.write_bytes("{{ prompt }} café".encode("latin-1"))
    with pytest.raises(TemplateError, match=rf"^{path}: not UTF-8 text \(byte 0xe9 at offset 16\)"):
        load_template(path)
    including = folder / "t.jinja"
    including.write_text("{{ prompt }}\n{% include 'latin1.jinja' %}")
    with pytest.raises(TemplateError, match=rf"^{including}:2: template 'latin1.jinja': {path}: not UTF-8 text"):
        _render(including)


def test_a_template_file_larger_than_a_prompt_is_refused(folder, monkeypatch):
    monkeypatch.setattr("selfopd.templating.template_files.MAX_RENDER_CHARS", 1000)
    path = folder / "big.jinja"
    path.write_text("{{ prompt }}" + "x" * 1000)
    with pytest.raises(TemplateError, match=rf"^{path}: a template file of 1,012 bytes, over the size limit of 1,000"):
        load_template(path)
