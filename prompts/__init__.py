"""The shipped Jinja templates (student/ and teacher/), installed as package data of
`selfopd.prompts` so that a wheel install renders them without the source tree."""
