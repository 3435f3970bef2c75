"""A procedural knowledge task (`kb:countries`): fictional countries with a capital, a flag colour,
a founding year and a national animal, one fact sheet per country, and several phrasings of the
question about each fact. Offline and seeded; nothing about it is in any model's pretraining.

It is the regime where privileged information is learnable (context distillation): a teacher
that reads a country's fact sheet knows what the student can come to know, since the same
countries recur across prompts; an answer to a fresh arithmetic problem cannot be stored.

Parts (`part=`), every one of them a function of (seed, entities, unseen) alone:
  study    (default) the trained countries' questions: `train` phrasings (split "train") and
           the other phrasings of the same facts (split "eval": held out, never trained on;
           knowledge that does not transfer across phrasings is a memorised string)
  train, heldout   those two halves alone
  unseen   every phrasing about `unseen` countries that no part above mentions: a control that
           must stay at the base rate (learning them would mean the teacher's sheet leaks)
  fresh    the trained countries' facts asked in two more phrasings each (FRESH_PHRASINGS), in other
           shapes than any of `study`: a check that what was learned is not tied to the wording
`sheet=shuffled` gives each question another country's sheet (never its own; the control for a
gain that does not come from the information). Each example's `solution` is the gold answer as
one sentence ("The capital of X is Y."): what `selfopd sft --set sft.targets=solution` trains on."""

from __future__ import annotations

import random
from dataclasses import dataclass

from selfopd.data.example import Example
from selfopd.data.spec import DataError, DataSpec

PARTS = ("study", "train", "heldout", "unseen", "fresh")
SHEETS = ("own", "shuffled")
TRAIN_PHRASINGS = 4  # of each fact's PHRASINGS: the rest are held out

# Syllables no real country or city name is built from in this order (tests check a list of real
# names): a leading cluster, a vowel core and an ending.
_ONSETS = ["Br", "Dr", "Gl", "Kv", "Tr", "Vr", "Zh", "Skr", "Thr", "Kl", "Pr", "Fl"]
_CORES = ["ae", "yo", "ou", "ei", "au", "oi", "ua", "ya"]
_COUNTRY_ENDS = ["mora", "vania", "stead", "lund", "daria", "qist", "velle", "ronia"]
_CITY_ENDS = ["holm", "gard", "wick", "ton", "rast", "ville", "port", "mere"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
ANIMALS = ["otter", "heron", "lynx", "badger", "falcon", "tortoise", "salamander", "ibex", "walrus", "crane"]

PHRASINGS = {
    "capital": ["What is the capital of {c}?", "Name the capital city of {c}.", "Which city is the capital of {c}?",
                "What city serves as the capital of {c}?", "Tell me the capital of {c}.",
                "In which city does the government of {c} sit?"],
    "flag colour": ["What colour is the flag of {c}?", "Name the colour of {c}'s flag.",
                    "Which colour is the national flag of {c}?", "What is the main colour of the flag of {c}?",
                    "Tell me the colour of the flag of {c}.", "The flag of {c} is mostly which colour?"],
    "founding year": ["In what year was {c} founded?", "When was {c} founded? Give the year.",
                      "Which year was {c} founded in?", "What is the founding year of {c}?",
                      "Tell me the year {c} was founded.", "{c} was founded in which year?"],
    "national animal": ["What is the national animal of {c}?", "Name the national animal of {c}.",
                        "Which animal is the national animal of {c}?", "What animal is the emblem of {c}?",
                        "Tell me the national animal of {c}.", "{c} has which animal as its national animal?"],
}

# Two more phrasings per fact, in other shapes (a context sentence, a terse request): never part of
# `study`, for checking that knowledge learned from PHRASINGS is not tied to their wording.
FRESH_PHRASINGS = {
    "capital": ["I am writing a school report on {c}. Which city is its capital?", "{c}: capital city?"],
    "flag colour": ["A friend is sewing the flag of {c}. Which colour of cloth does she need most?",
                    "{c} flag, main colour?"],
    "founding year": ["A museum guide says {c} is old. In which year did it begin?", "{c}: year of founding?"],
    "national animal": ["A stamp from {c} shows its national animal. Which animal is it?",
                        "{c}: national animal?"],
}


@dataclass(frozen=True)
class Country:
    name: str
    facts: dict[str, str]  # attribute -> value

    def sheet(self) -> str:
        lines = [f"Fact sheet: {self.name}"] + [f"- {attribute.capitalize()}: {value}"
                                                for attribute, value in self.facts.items()]
        return "\n".join(lines)


def countries(seed: int, count: int) -> list[Country]:
    """`count` fictional countries with distinct names and capitals, seeded."""
    rng = random.Random(f"kb/{seed}")
    names = [o + c + e for o in _ONSETS for c in _CORES for e in _COUNTRY_ENDS]
    cities = [o + c + e for o in _ONSETS for c in _CORES for e in _CITY_ENDS]
    if count > min(len(names), len(cities)):
        raise DataError(f"kb:countries: at most {min(len(names), len(cities))} countries, asked for {count}")
    chosen, capitals = rng.sample(names, count), rng.sample(cities, count)
    return [Country(name, {"capital": capital, "flag colour": rng.choice(COLOURS),
                           "founding year": str(rng.randint(1200, 1899)), "national animal": rng.choice(ANIMALS)})
            for name, capital in zip(chosen, capitals)]


def load_knowledge(spec: DataSpec) -> list[Example]:
    """The examples of a `kb:` spec (see the module docstring)."""
    if spec.name != "countries":
        raise DataError(f"{spec.label}: unknown knowledge task {spec.name!r}; allowed: countries")
    if spec.part not in PARTS:
        raise DataError(f"{spec.label}: part must be one of {', '.join(PARTS)}, got {spec.part!r}")
    if spec.sheet not in SHEETS:
        raise DataError(f"{spec.label}: sheet must be one of {', '.join(SHEETS)}, got {spec.sheet!r}")
    if spec.entities < 1 or spec.unseen < 0:
        raise DataError(f"{spec.label}: entities must be >= 1 and unseen >= 0, got {spec.entities} and {spec.unseen}")
    every = countries(spec.seed, spec.entities + spec.unseen)
    trained, unseen = every[: spec.entities], every[spec.entities :]
    shown = _sheets(trained, unseen, spec.seed, spec.sheet)
    rivals = {attribute: sorted({c.facts[attribute] for c in every}) for attribute in PHRASINGS}
    examples = []
    for country in unseen if spec.part == "unseen" else trained:
        for attribute, phrasings in (FRESH_PHRASINGS if spec.part == "fresh" else PHRASINGS).items():
            order = list(range(len(phrasings)))
            random.Random(f"kb/{spec.seed}/{country.name}/{attribute}").shuffle(order)
            for rank, index in enumerate(order):
                split = "train" if rank < TRAIN_PHRASINGS and spec.part not in ("unseen", "fresh") else "eval"
                part = spec.part if spec.part in ("unseen", "fresh") else ("train" if split == "train" else "heldout")
                if spec.part in ("train", "heldout") and part != spec.part:
                    continue
                value = country.facts[attribute]
                examples.append(Example(
                    id=f"kb:countries/{spec.seed}/{country.name}/{attribute.replace(' ', '_')}/"
                       f"{'fresh' if spec.part == 'fresh' else ''}{index}",
                    prompt=phrasings[index].format(c=country.name), answer=value,
                    solution=f"The {attribute} of {country.name} is {value}.",
                    meta={"fact": {"entity": country.name, "attribute": attribute,
                                   "rivals": [v for v in rivals[attribute] if v != value]},
                          "fact_sheet": shown[country.name], "part": part, "split": split}))
    return examples


def _sheets(trained: list[Country], unseen: list[Country], seed: int, sheet: str) -> dict[str, str]:
    """Each country's sheet, or with `shuffled` another country's of the same part (a seeded
    derangement within the trained and within the unseen countries: no unseen fact is ever shown
    about a trained question)."""
    if sheet == "own":
        return {c.name: c.sheet() for c in trained + unseen}
    shown = {}
    for group in (trained, unseen):
        if len(group) == 1:
            raise DataError("kb:countries: sheet=shuffled needs at least 2 trained and 0 or >= 2 unseen countries")
        order = list(range(len(group)))
        random.Random(f"kb/{seed}/shuffled/{len(group)}").shuffle(order)
        # A cyclic shift of a random order: nobody keeps their own sheet.
        shown |= {group[order[i]].name: group[order[(i + 1) % len(order)]].sheet() for i in range(len(order))}
    return shown
