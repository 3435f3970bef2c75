import copy

import pytest
import torch

from selfopd.diagnostics.drift import drift, general_prompts, position_kl
from selfopd.templating.chat_format import ChatFormat


def _perturbed(model, scale: float = 0.05):
    other = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * torch.randn_like(parameter))
    return other


def test_position_kl_matches_a_float64_brute_force_over_prefixes(tiny_llama):
    reference = _perturbed(tiny_llama)
    prompt, completion = [3, 17, 5, 9], [11, 40, 2, 63, 7]
    got = position_kl(tiny_llama, reference, prompt, completion)
    expected = []
    for t in range(len(completion)):  # the distribution of completion token t: a forward of its prefix alone
        prefix = torch.tensor([prompt + completion[:t]])
        with torch.no_grad():
            p = torch.softmax(tiny_llama(prefix).logits[0, -1].double(), -1)
            q = torch.softmax(reference(prefix).logits[0, -1].double(), -1)
        expected.append(sum(float(p[v] * (torch.log(p[v]) - torch.log(q[v]))) for v in range(p.numel())))
    assert got.dtype == torch.float64 and got.shape == (len(completion),)
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert min(expected) > 0
    assert position_kl(tiny_llama, tiny_llama, prompt, completion).abs().max() == 0


def test_drift_is_zero_for_the_start_model_and_grows_with_the_change(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = general_prompts()[:4]
    same = drift(model, model, ChatFormat(tokenizer), prompts, samples=2, max_tokens=8, progress=False)
    assert same.kl.value == 0 and same.kl.n == 4 and set(same.per_prompt) == set(prompts)
    assert 0 < same.tokens <= 4 * 2 * 8
    small = drift(model, _perturbed(model, 0.01), ChatFormat(tokenizer), prompts, samples=2, max_tokens=8, progress=False)
    large = drift(model, _perturbed(model, 0.1), ChatFormat(tokenizer), prompts, samples=2, max_tokens=8, progress=False)
    assert small.tokens == same.tokens  # the same samples: they come from `model` with one seed
    assert 0 < small.kl.value < large.kl.value


def test_general_prompts_ship_with_the_package_and_an_empty_file_is_named(tmp_path):
    prompts = general_prompts()
    assert len(prompts) == 48 and len(set(prompts)) == 48
    empty = tmp_path / "none.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="none.txt"):
        general_prompts(empty)


def test_the_drift_command_writes_its_summary_and_names_what_is_missing(tiny_model_dir, tmp_path, capsys):
    import json

    from selfopd.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Why is the sea salty?\nWrite a line about rain.\n")
    out = tmp_path / "drift"
    assert main(["drift", "--model", str(tiny_model_dir), "--reference", str(tiny_model_dir), "--prompts", str(prompts),
                 "--samples", "1", "--max-tokens", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kl"]["value"] == 0 and summary["kl"]["n"] == 2 and summary["tokens"] > 0
    assert main(["drift", "--model", str(tiny_model_dir)]) == 1
    assert "--reference" in capsys.readouterr().err
