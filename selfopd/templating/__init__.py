"""Prompts: Jinja templates rendered for the student and the privileged teacher, checked against the models' contexts."""
