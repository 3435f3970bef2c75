"""selfopd.data.knowledge (`kb:countries`): the parts are disjoint as claimed, the shuffled sheet
is never a question's own, the task is a function of its seed, the names are not real ones, and a
source's fixed split is what `split_examples` returns."""

from __future__ import annotations

import pytest

from selfopd.data import DataError, load_examples
from selfopd.data.example import prompt_key
from selfopd.data.knowledge import PHRASINGS, TRAIN_PHRASINGS
from selfopd.data.split import split_examples

# Countries and capitals a model may know: none may be generated.
REAL = {"France", "Paris", "Germany", "Berlin", "Norway", "Oslo", "Sweden", "Stockholm", "Denmark", "Copenhagen",
        "Moldova", "Chisinau", "Slovenia", "Ljubljana", "Romania", "Bucharest", "Estonia", "Tallinn", "Latvia",
        "Riga", "Lithuania", "Vilnius", "Poland", "Warsaw", "Austria", "Vienna", "Albania", "Tirana", "Armenia",
        "Yerevan", "Georgia", "Tbilisi", "Transylvania", "Moravia", "Bohemia", "Pomerania", "Livonia", "Courland",
        "Ruritania", "Freedonia", "Genovia", "Latveria", "Wakanda", "Westeros", "Gondor", "Rohan", "Narnia",
        "Stockton", "Kingston", "Portsmouth", "Glasgow", "Trondheim", "Bergen", "Reykjavik"}


def test_held_out_phrasings_and_unseen_countries_are_disjoint_from_training():
    study = load_examples("kb:countries")
    train = [e for e in study if e.meta["split"] == "train"]
    heldout = [e for e in study if e.meta["split"] == "eval"]
    unseen = load_examples("kb:countries?part=unseen")
    assert len(train) == 24 * len(PHRASINGS) * TRAIN_PHRASINGS and len(unseen) == 8 * len(PHRASINGS) * 6
    train_prompts = {prompt_key(e.prompt) for e in train}
    assert not train_prompts & {prompt_key(e.prompt) for e in heldout + unseen}
    # every held-out question asks a fact the training questions ask too, in other words
    trained_facts = {(e.meta["fact"]["entity"], e.meta["fact"]["attribute"]) for e in train}
    assert {(e.meta["fact"]["entity"], e.meta["fact"]["attribute"]) for e in heldout} <= trained_facts
    # no unseen country is named by any training question or shown by any training sheet
    unseen_names = {e.meta["fact"]["entity"] for e in unseen}
    for sheet in ("own", "shuffled"):
        for e in load_examples(f"kb:countries?part=train&sheet={sheet}"):
            assert not any(name in e.prompt or name in e.meta["fact_sheet"] for name in unseen_names)
    assert [e.id for e in load_examples("kb:countries?part=train")] == [e.id for e in train]
    assert [e.id for e in load_examples("kb:countries?part=heldout")] == [e.id for e in heldout]


def test_the_shuffled_sheet_is_never_the_questions_own_and_the_own_sheet_holds_the_answer():
    for spec in ("kb:countries?sheet=shuffled", "kb:countries?sheet=shuffled&part=unseen",
                 "kb:countries?sheet=shuffled&entities=2&unseen=2&seed=5"):
        for e in load_examples(spec):
            assert not e.meta["fact_sheet"].startswith(f"Fact sheet: {e.meta['fact']['entity']}\n")
    for e in load_examples("kb:countries"):
        assert e.meta["fact_sheet"].startswith(f"Fact sheet: {e.meta['fact']['entity']}\n")
        assert f": {e.answer}" in e.meta["fact_sheet"] and e.answer not in e.meta["fact"]["rivals"]


def test_the_task_is_a_function_of_its_seed_and_its_names_are_not_real():
    a, b = load_examples("kb:countries?seed=3"), load_examples("kb:countries?seed=3")
    assert a == b and a != load_examples("kb:countries?seed=4")
    every = load_examples("kb:countries") + load_examples("kb:countries?part=unseen")
    names = {e.meta["fact"]["entity"] for e in every} | {e.answer for e in every if e.meta["fact"]["attribute"] == "capital"}
    assert len(names) == 2 * 32 and not names & REAL


def test_the_split_is_the_sources_own():
    study = load_examples("kb:countries")
    train, held_out = split_examples(study, eval_size=192, seed=0)
    assert {e.meta["part"] for e in train} == {"train"} and {e.meta["part"] for e in held_out} == {"heldout"}
    assert len(train) == 384 and len(held_out) == 192
    train, fewer = split_examples(study, eval_size=50, seed=1)
    assert len(train) == 384 and len(fewer) == 50 and {e.meta["part"] for e in fewer} == {"heldout"}
    _, capped = split_examples(study, eval_size=500, seed=0)  # the source's held-out rows, all of them
    assert [e.id for e in capped] == [e.id for e in held_out]
    unmarked = study[0].__class__(id="x", prompt="What is 1 + 1?", answer="2")
    with pytest.raises(DataError, match="example 'x' has meta split None"):
        split_examples([*study, unmarked], eval_size=10, seed=0)


@pytest.mark.parametrize("spec, message", [
    ("kb:planets", "unknown knowledge task 'planets'"),
    ("kb:countries?part=all", "part must be one of"),
    ("kb:countries?sheet=other", "sheet must be one of"),
    ("kb:countries?entities=0", "entities must be >= 1"),
    ("kb:countries?size=10", "unknown option 'size' for source 'kb'"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(DataError, match=message):
        load_examples(spec)


def test_each_solution_is_the_gold_answer_as_a_sentence_the_verifier_passes():
    from selfopd.verifiers import verify_example

    examples = load_examples("kb:countries?entities=3&unseen=2")
    assert all(e.solution.endswith(f" is {e.answer}.") and e.meta["fact"]["entity"] in e.solution for e in examples)
    assert all(verify_example(e.solution, e).correct for e in examples)
    assert not any(verify_example(e.solution.replace(e.answer, e.meta["fact"]["rivals"][0]), e).correct for e in examples)


def test_the_fresh_phrasings_ask_the_trained_facts_in_words_no_other_part_uses():
    from selfopd.data.knowledge import FRESH_PHRASINGS

    fresh, study = load_examples("kb:countries?entities=3&unseen=2&part=fresh"), load_examples("kb:countries?entities=3&unseen=2")
    assert len(fresh) == 3 * 4 * 2 and {e.meta["part"] for e in fresh} == {"fresh"}
    assert not {prompt_key(e.prompt) for e in fresh} & {prompt_key(e.prompt) for e in study}
    assert not {e.id for e in fresh} & {e.id for e in study}
    by_fact = {(e.meta["fact"]["entity"], e.meta["fact"]["attribute"]): e.answer for e in study}
    assert all(by_fact[e.meta["fact"]["entity"], e.meta["fact"]["attribute"]] == e.answer for e in fresh)
    templates = [t for ts in PHRASINGS.values() for t in ts]
    assert not set(t for ts in FRESH_PHRASINGS.values() for t in ts) & set(templates)
