"""The errors of templates: selfopd's prompt templates (`templates`) and a model's own chat
template (`chat_template`), both user errors that name the file."""

from __future__ import annotations


class TemplateError(ValueError):
    """A template that cannot be found, parsed or rendered; the message names the file."""


class TemplateLimitError(TemplateError):
    """A template that went past a size, work or time limit while rendering."""
