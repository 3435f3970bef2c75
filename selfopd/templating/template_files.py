"""Which files a template may pull in with `{% include %}`, `{% extends %}` or `{% import %}`.

A template is text from a config, a colleague or a run folder; what it includes goes into
prompts, into a run's kept copies (RUN/templates/local/) and into record archives. So a
template reaches only other templates: `.jinja` files in its own folder (and below), in a run's
templates/ folder when it renders from one, and in the shipped `prompts/`. A name that is
absolute, climbs with `..`, is not a `.jinja` file, or is a link leading out of the folder it
sits in is refused with an `IncludeRefused` naming it; `jinja2.TemplateNotFound` stays for a
well-formed name that no folder holds. Every template file is UTF-8 text no larger than the
largest prompt a template may render.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Callable, Sequence

import jinja2
from jinja2.sandbox import SecurityError

from selfopd.templating.sandbox import MAX_RENDER_CHARS

SUFFIX = ".jinja"


class IncludeRefused(SecurityError):
    """A name a template may not include, extend or import; the message names it and why."""


class TemplateFileError(ValueError):
    """A template file that cannot be read as a template: not UTF-8, or too large."""


def read_template_file(path: Path) -> str:
    """The text of a template file; anything but UTF-8 text of at most MAX_RENDER_CHARS bytes
    is a TemplateFileError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_RENDER_CHARS:
            raise TemplateFileError(f"{path}: a template file of {size:,} bytes, over the size limit of "
                                    f"{MAX_RENDER_CHARS:,} (the longest prompt a template may render)")
        data = path.read_bytes()
    except OSError as error:
        raise TemplateFileError(f"{path}: cannot read the template: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TemplateFileError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
                                "save the template as UTF-8") from None


def refusal(name: str) -> str | None:
    """Why `name` may not be included, extended or imported (None: it may, if a folder holds it)."""
    if "\\" in name or "\x00" in name:
        return "a name with a backslash or NUL"
    path = PurePosixPath(name)
    if path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if ".." in path.parts:
        return "a path with '..'"
    if path.suffix != SUFFIX:
        return f"not a {SUFFIX} template"
    return None


class FolderLoader(jinja2.BaseLoader):
    """Loads `.jinja` templates from `folders`, first match wins, and nothing else."""

    def __init__(self, folders: Sequence[Path]) -> None:
        self.folders = list(dict.fromkeys(Path(folder).resolve() for folder in folders))

    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str, Callable[[], bool]]:
        reason = refusal(template) if isinstance(template, str) else "not a name"
        if reason is not None:
            raise IncludeRefused(f"{template!r} refused: {reason}; {self.rule()}")
        for folder in self.folders:
            path = folder.joinpath(*PurePosixPath(template).parts)
            if not path.is_file():
                continue
            real = path.resolve()
            if not real.is_relative_to(folder) or real.suffix != SUFFIX:
                raise IncludeRefused(f"{template!r} refused: a link leading out of {folder} or to a file that is "
                                     f"not a {SUFFIX} template; {self.rule()}")
            try:
                source = read_template_file(real)
            except TemplateFileError as error:
                raise IncludeRefused(f"{template!r}: {error}") from None
            mtime = os.path.getmtime(real)
            return source, str(real), lambda: _unchanged(real, mtime)
        raise jinja2.TemplateNotFound(template)

    def rule(self) -> str:
        return (f"a template may include, extend or import only {SUFFIX} files in "
                f"{' or '.join(str(folder) for folder in self.folders)}")


def _unchanged(path: Path, mtime: float) -> bool:
    try:
        return os.path.getmtime(path) == mtime
    except OSError:
        return False

