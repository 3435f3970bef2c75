"""selfopd.training.divergences: full-vocabulary reverse KL, forward KL and
JSD(beta), top-k reverse KL with a tail bucket, and the sampled-token estimator they
generalise. Values and gradients are pinned against float64 references written straight
from the definitions (log_softmax over the whole vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch

from selfopd.engines.kernels import token_logprobs_from_hidden
from selfopd.training.advantages import opd_advantage
from selfopd.training.divergences import entry_clipped_divergence, full_vocab_divergence, topk_reverse_kl, topk_tail_logprob
from selfopd.training.loss import masked_mean, policy_gradient_loss

torch.set_num_threads(1)  # the test machine's cores are shared; these tensors are tiny anyway

B, T, H, V, K = 2, 7, 5, 11, 3
FULL = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.3), ("jsd", 0.5)]
VARIANTS = [*FULL, ("topk", 0.0)]
# Every variant with the teacher as logits; the full-vocabulary ones also as hidden + unembedding.
WITH_TEACHER = [(v, b, "logits") for v, b in VARIANTS] + [(v, b, "hidden") for v, b in FULL]


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Student hidden + unembedding, a teacher as logits and as hidden + its own unembedding
    (another hidden size), a mask with prompt and padding positions, loss weights."""
    g = torch.Generator().manual_seed(seed)
    mask_BT = torch.ones(B, T, dtype=torch.bool)
    mask_BT[0, :2] = False  # prompt
    mask_BT[1, 5:] = False  # padding
    return {
        "hidden": torch.randn(B, T, H, generator=g, dtype=dtype),
        "weight": torch.randn(V, H, generator=g, dtype=dtype),
        "teacher_logits": 2 * torch.randn(B, T, V, generator=g, dtype=dtype),
        "teacher_hidden": torch.randn(B, T, H + 2, generator=g, dtype=dtype),
        "teacher_weight": torch.randn(V, H + 2, generator=g, dtype=dtype),
        "mask": mask_BT,
        "weights": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def _teacher_topk(teacher_logits_BTV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.log_softmax(teacher_logits_BTV, dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def _run(variant: str, beta: float, x: dict, teacher: str = "logits", chunk_size: int = 3, k: int = K, tail_floor: float = 0.0):
    """The implementation under test, per-token values (B, T)."""
    if variant == "topk":
        ids_BTK, lp_BTK = _teacher_topk(x["teacher_logits"], k)
        return topk_reverse_kl(x["hidden"], x["weight"], ids_BTK, lp_BTK, x["mask"], tail_floor=tail_floor, chunk_size=chunk_size)
    kw = {"teacher_logits_BTV": x["teacher_logits"]} if teacher == "logits" else {"teacher_hidden_BTH": x["teacher_hidden"], "teacher_weight_VH": x["teacher_weight"]}
    return full_vocab_divergence(x["hidden"], x["weight"], x["mask"], divergence=variant, beta=beta, chunk_size=chunk_size, **kw)


def _reference(variant: str, beta: float, x: dict, teacher: str = "logits", k: int = K, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """float64 (or `dtype`), from the definitions; differentiable in x["hidden"] and x["weight"]."""
    s_lp = torch.log_softmax(x["hidden"].to(dtype) @ x["weight"].to(dtype).T, dim=-1)
    t_logits = x["teacher_logits"] if teacher == "logits" else x["teacher_hidden"] @ x["teacher_weight"].T
    t_lp = torch.log_softmax(t_logits.detach().to(dtype), dim=-1)
    s, t = s_lp.exp(), t_lp.exp()
    if variant == "reverse_kl":
        values = (s * (s_lp - t_lp)).sum(-1)
    elif variant == "forward_kl":
        values = (t * (t_lp - s_lp)).sum(-1)
    elif variant == "jsd":
        m = beta * t + (1 - beta) * s
        values = beta * (t * (t_lp - m.log())).sum(-1) + (1 - beta) * (s * (s_lp - m.log())).sum(-1)
    else:  # top-k buckets + tail, written out
        ids, top_lp = _teacher_topk(x["teacher_logits"].to(dtype), k)
        s_top = s.gather(-1, ids)
        s_b = torch.cat([s_top, 1 - s_top.sum(-1, keepdim=True)], dim=-1)
        t_b = torch.cat([top_lp.exp(), 1 - top_lp.exp().sum(-1, keepdim=True)], dim=-1)
        values = (s_b * (s_b.log() - t_b.log())).sum(-1)
    return torch.where(x["mask"], values, 0.0)


def _values_and_grads(fn, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight = x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True)
    values_BT = fn()
    grad_hidden, grad_weight = torch.autograd.grad((x["weights"].to(values_BT.dtype) * values_BT).sum(), (hidden, weight))
    return values_BT.detach(), grad_hidden, grad_weight


# ---- against the float64 reference --------------------------------------------------------


@pytest.mark.parametrize("variant, beta, teacher", WITH_TEACHER)
def test_values_and_gradients_match_float64_reference(variant, beta, teacher):
    """fp32 inputs: values (computed in fp32) and the gradients reaching the student's hidden
    states and unembedding; the teacher gets none."""
    x = _inputs()
    x["teacher_hidden"].requires_grad_(True)
    x["teacher_logits"].requires_grad_(True)
    actual = _values_and_grads(lambda: _run(variant, beta, x, teacher), x)
    reference = _values_and_grads(lambda: _reference(variant, beta, x, teacher), x)
    assert actual[0].dtype == torch.float32
    assert reference[0][x["mask"]].abs().min() > 1e-3  # not a trivially zero case
    for got, want in zip(actual, reference):
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    assert x["teacher_hidden"].grad is None and x["teacher_logits"].grad is None


@pytest.mark.parametrize("variant, beta", VARIANTS)
def test_large_vocabulary_is_as_accurate_as_plain_float32(variant, beta):
    """V = 49152 (SmolLM2): no further from float64 than the same definition evaluated
    in fp32 (log_softmax, torch.sum). A sum over the vocabulary accumulated sequentially in
    fp32 (e.g. a batched dot product) would be off by ~1.3e-5, 8x more."""
    g = torch.Generator().manual_seed(10)
    vocab, hidden = 49152, 16
    x = {
        "hidden": torch.randn(1, 8, hidden, generator=g),
        "weight": torch.randn(vocab, hidden, generator=g) * (3 / math.sqrt(hidden)),
        "mask": torch.ones(1, 8, dtype=torch.bool),
    }
    x["teacher_logits"] = x["hidden"] @ x["weight"].T + torch.randn(1, 8, vocab, generator=g)
    reference = _reference(variant, beta, x, k=20)
    plain_error = (_reference(variant, beta, x, k=20, dtype=torch.float32).double() - reference).abs().max().item()
    error = (_run(variant, beta, x, k=20).double() - reference).abs().max().item()
    assert error <= 1.5 * plain_error + 1e-6, (error, plain_error)


@pytest.mark.parametrize("variant, beta", VARIANTS)
def test_float64_stays_float64_and_passes_gradcheck(variant, beta):
    x = _inputs(torch.float64, seed=1)
    assert torch.allclose(_run(variant, beta, x), _reference(variant, beta, x), rtol=0, atol=1e-12)

    def fn(hidden, weight):
        return _run(variant, beta, {**x, "hidden": hidden, "weight": weight}, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True)))


def test_bfloat16_inputs_are_scored_in_float32():
    """bf16 hidden states and head: the head's matmul and all that follows run in fp32 (bf16
    logits would be off by up to ~0.1 nats), so the result is the float64 one on those inputs."""
    x = _inputs(torch.bfloat16, seed=2)
    actual = _run("reverse_kl", 0.5, x)
    s_lp = torch.log_softmax(x["hidden"].double() @ x["weight"].double().T, dim=-1)
    t_lp = torch.log_softmax(x["teacher_logits"].double(), dim=-1)
    reference = torch.where(x["mask"], (s_lp.exp() * (s_lp - t_lp)).sum(-1), 0.0)
    assert actual.dtype == torch.float32
    assert torch.allclose(actual.double(), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant, beta", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_size_changes_nothing(variant, beta, dtype):
    """T = 7: chunks of 1, 3 (does not divide T), 7 and 100 (more than T). In float64 the
    results agree to rounding; in fp32 to what fp32 can promise when the BLAS sums the
    weight gradient over another number of rows (one machine differed by 5.5e-7 at values
    of order 1 where another agreed to 1e-7): a few ulps of the largest entry."""
    x = _inputs(dtype=dtype, seed=3)
    runs = [_values_and_grads(lambda: _run(variant, beta, x, chunk_size=c), x) for c in (1, 3, T, 100)]
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            bound = 1e-12 if dtype == torch.float64 else 64 * torch.finfo(dtype).eps * want.abs().max().item()
            assert (got - want).abs().max().item() <= bound


# ---- masking ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant, beta, teacher", WITH_TEACHER)
def test_masked_positions_with_garbage_are_exactly_zero(variant, beta, teacher):
    """inf/nan hidden states, teacher logits, teacher top-k logprobs and out-of-range ids on
    prompt and padding positions: value and gradient there are exactly 0, and everything
    else is what it is with clean inputs there."""
    clean = _inputs(seed=4)
    dirty = {key: value.clone() for key, value in clean.items()}
    off = ~clean["mask"]
    dirty["hidden"][off] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 1.0])
    dirty["teacher_logits"][off] = math.nan
    dirty["teacher_hidden"][off] = math.inf
    runs = []
    for x in (clean, dirty):
        if variant == "topk":
            ids_BTK, lp_BTK = _teacher_topk(clean["teacher_logits"], K)
            if x is dirty:
                ids_BTK[off], lp_BTK[off] = -1, math.nan

            def fn(x=x, ids_BTK=ids_BTK, lp_BTK=lp_BTK):
                return topk_reverse_kl(x["hidden"], x["weight"], ids_BTK, lp_BTK, x["mask"], chunk_size=3)
        else:

            def fn(x=x):
                return _run(variant, beta, x, teacher)

        runs.append(_values_and_grads(fn, x))
    (clean_values, clean_grad_hidden, clean_grad_weight), (values, grad_hidden, grad_weight) = runs
    assert torch.equal(values[off], torch.zeros(int(off.sum())))
    assert torch.equal(grad_hidden[off], torch.zeros(int(off.sum()), H))
    assert torch.allclose(values, clean_values, rtol=0, atol=1e-6)
    assert torch.allclose(grad_hidden, clean_grad_hidden, rtol=0, atol=1e-6)
    assert torch.allclose(grad_weight, clean_grad_weight, rtol=0, atol=1e-6)
    loss = masked_mean(values, clean["mask"])
    assert torch.isfinite(loss) and torch.isfinite(grad_weight).all()


def test_masked_mean_by_hand():
    """values [[1, 2, nan], [4, inf, inf]] with mask [[1, 1, 0], [1, 0, 0]]."""
    values_BT = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, math.inf]], requires_grad=True)
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values_BT, mask_BT, "token").item() == pytest.approx(7 / 3)
    sequence = masked_mean(values_BT, mask_BT, "sequence")
    assert sequence.item() == pytest.approx((1.5 + 4) / 2)
    sequence.backward()
    assert torch.equal(values_BT.grad, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]))
    assert masked_mean(values_BT.detach(), torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="normalisation"):
        masked_mean(values_BT, mask_BT, "batch")  # type: ignore[arg-type]


# ---- top-k with a tail bucket -------------------------------------------------------------


def test_topk_with_k_equal_to_vocabulary_is_the_full_reverse_kl():
    """K = V: the tail is empty on both sides (the teacher's rounds to ~0 and is floored);
    values and gradients equal the full-vocabulary reverse KL."""
    x = _inputs(seed=5)
    full = _values_and_grads(lambda: _run("reverse_kl", 0.5, x), x)
    topk = _values_and_grads(lambda: _run("topk", 0.0, x, k=V, tail_floor=1e-6), x)
    for got, want in zip(topk, full):  # two fp32 computations of values up to ~10: a few ulps apart
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_topk_is_a_divergence_below_the_full_reverse_kl():
    """Merging outcomes into buckets never raises a KL (data processing), and top-k of the
    student's own distribution gives 0; without the tail bucket neither would hold."""
    x = _inputs(torch.float64, seed=6)
    for k in (1, 3, 6):
        topk = _run("topk", 0.0, x, k=k)
        assert (topk >= 0).all() and (topk <= _run("reverse_kl", 0.5, x) + 1e-12).all()
    x["teacher_logits"] = x["hidden"] @ x["weight"].T
    assert _run("topk", 0.0, x).abs().max() < 1e-12


def test_tail_logprob_is_the_missing_mass():
    """log(1 - sum p) for a tail of 0.3 down to 1e-12 (float64 input; relative error of the
    tail mass 1e-4, what rounding the inputs allows), fp32 input with a 1e-4 tail, and a top-k
    that sums to >= 1 through rounding: -inf, or the floor."""
    for tail in (0.3, 1e-4, 1e-12):
        top_K = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64) * (1 - tail))
        assert topk_tail_logprob(top_K).item() == pytest.approx(math.log(tail), abs=1e-4)
    top_K = torch.log(torch.tensor([0.6, 0.3, 0.1 - 1e-4]))
    assert topk_tail_logprob(top_K).item() == pytest.approx(math.log(1e-4), abs=1e-2)
    assert topk_tail_logprob(top_K).dtype == torch.float32
    over_K = torch.log(torch.tensor([0.7, 0.3 + 1e-6]))
    assert topk_tail_logprob(over_K).item() == -math.inf
    assert topk_tail_logprob(over_K, floor=1e-6).item() == pytest.approx(math.log(1e-6))
    assert topk_tail_logprob(torch.zeros(1)).item() == -math.inf  # p = 1: no tail, no nan


def test_tail_floor_keeps_a_confident_teacher_finite():
    """A teacher whose top-1 logprob rounded to 0 has no tail: with tail_floor = 0 any student
    tail mass makes the KL infinite; the default floor keeps it finite."""
    x = _inputs(seed=7)
    ids_BTK = torch.arange(K).expand(B, T, K)
    lp_BTK = torch.tensor([0.0, -30.0, -30.0]).expand(B, T, K)
    exact = topk_reverse_kl(x["hidden"], x["weight"], ids_BTK, lp_BTK, x["mask"], tail_floor=0.0)
    floored = topk_reverse_kl(x["hidden"], x["weight"], ids_BTK, lp_BTK, x["mask"])
    assert (exact[x["mask"]] == math.inf).all()
    assert torch.isfinite(floored).all() and (floored[x["mask"]] > 0).all()


# ---- JSD(beta) ----------------------------------------------------------------------------


def test_jsd_ends_symmetry_and_bound():
    """TRL's convention: beta = 0 is forward KL and beta = 1 reverse KL, the limits of
    JSD / beta and JSD / (1 - beta); swapping student and teacher is beta -> 1 - beta; and
    0 <= JSD(beta) <= the binary entropy of beta."""
    x = _inputs(torch.float64, seed=8)
    forward, reverse = _run("forward_kl", 0.5, x, "hidden"), _run("reverse_kl", 0.5, x, "hidden")
    assert torch.equal(_run("jsd", 0.0, x, "hidden"), forward)
    assert torch.equal(_run("jsd", 1.0, x, "hidden"), reverse)
    eps = 1e-9
    assert torch.allclose(_run("jsd", eps, x, "hidden") / eps, forward, rtol=1e-4, atol=0)
    assert torch.allclose(_run("jsd", 1 - eps, x, "hidden") / eps, reverse, rtol=1e-4, atol=0)
    swapped = {**x, "hidden": x["teacher_hidden"], "weight": x["teacher_weight"], "teacher_hidden": x["hidden"], "teacher_weight": x["weight"]}
    for beta in (0.2, 0.5):
        jsd = _run("jsd", beta, x, "hidden")
        assert torch.allclose(jsd, _run("jsd", 1 - beta, swapped, "hidden"), rtol=0, atol=1e-12)
        entropy = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert (jsd >= 0).all() and (jsd <= entropy).all()
    with pytest.raises(ValueError, match="beta"):
        _run("jsd", 1.5, x)


# ---- the sampled-token estimator ----------------------------------------------------------


def test_sampled_estimator_is_unbiased_for_the_full_reverse_kl():
    """Monte Carlo, one position, V = 6, 20000 tokens drawn from the student: the mean of
    log s(y) - log t(y) (= -opd_advantage) is the full reverse KL, and the gradient of the
    trainer's policy_gradient_loss is the gradient of the full reverse KL, each within 5
    standard errors; the forward KL, value or gradient, is far outside them."""
    g = torch.Generator().manual_seed(0)
    N, vocab = 20000, 6
    student_V = 2 * torch.randn(vocab, generator=g, dtype=torch.float64)  # reverse KL 1.08, forward KL 2.01
    teacher_V = torch.randn(vocab, generator=g, dtype=torch.float64)
    eye_VV = torch.eye(vocab, dtype=torch.float64)  # hidden = logits, so d/dhidden = d/dlogits
    tokens_N1 = torch.multinomial(torch.softmax(student_V, 0), N, replacement=True, generator=g)[:, None]

    hidden_N1V = student_V.expand(N, 1, vocab).clone().requires_grad_(True)
    student_lp_N1 = token_logprobs_from_hidden(hidden_N1V, eye_VV, tokens_N1)
    teacher_lp_N1 = torch.log_softmax(teacher_V, 0)[tokens_N1]
    mask_N1 = torch.ones(N, 1, dtype=torch.bool)
    advantage_N1 = opd_advantage(teacher_lp_N1, student_lp_N1, mask_N1)
    policy_gradient_loss(student_lp_N1, advantage_N1, mask_N1).backward()
    estimate_N, grad_NV = -advantage_N1[:, 0], N * hidden_N1V.grad[:, 0]  # per-sample terms

    def full(divergence: str) -> tuple[float, torch.Tensor]:
        hidden_11V = student_V.view(1, 1, vocab).clone().requires_grad_(True)
        value = full_vocab_divergence(hidden_11V, eye_VV, torch.ones(1, 1), teacher_logits_BTV=teacher_V.view(1, 1, vocab), divergence=divergence)
        value.sum().backward()
        return value.item(), hidden_11V.grad.view(vocab)

    (reverse, reverse_grad_V), (forward, forward_grad_V) = full("reverse_kl"), full("forward_kl")
    value_se = estimate_N.std().item() / math.sqrt(N)
    grad_se_V = grad_NV.std(dim=0) / math.sqrt(N)
    assert abs(estimate_N.mean().item() - reverse) < 5 * value_se
    assert ((grad_NV.mean(dim=0) - reverse_grad_V).abs() < 5 * grad_se_V).all()
    assert abs(estimate_N.mean().item() - forward) > 20 * value_se
    assert ((grad_NV.mean(dim=0) - forward_grad_V).abs() > 20 * grad_se_V).any()


# ---- each vocabulary entry's term capped (loss.clip_per = "vocabulary_entry", OPSD's clip) ----

ENTRY = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.3), ("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0)]


def _entry_run(variant: str, beta: float, x: dict, clip: float, teacher: str = "logits", chunk_size: int = 3):
    kw = {"teacher_logits_BTV": x["teacher_logits"]} if teacher == "logits" else {"teacher_hidden_BTH": x["teacher_hidden"], "teacher_weight_VH": x["teacher_weight"]}
    return entry_clipped_divergence(x["hidden"], x["weight"], x["mask"], clip, divergence=variant, beta=beta,
                                    chunk_size=chunk_size, **kw)


def _entry_terms(variant: str, beta: float, x: dict, teacher: str = "logits") -> torch.Tensor:
    """(B, T, V) float64 terms d_v, from the definitions (jsd at beta 0 / 1: forward / reverse KL, as TRL)."""
    s_lp = torch.log_softmax(x["hidden"].double() @ x["weight"].double().T, dim=-1)
    t_logits = x["teacher_logits"] if teacher == "logits" else x["teacher_hidden"] @ x["teacher_weight"].T
    t_lp = torch.log_softmax(t_logits.detach().double(), dim=-1)
    s, t = s_lp.exp(), t_lp.exp()
    if variant == "jsd" and beta in (0.0, 1.0):
        variant = "forward_kl" if beta == 0.0 else "reverse_kl"
    if variant == "reverse_kl":
        return s * (s_lp - t_lp)
    if variant == "forward_kl":
        return t * (t_lp - s_lp)
    m = beta * t + (1 - beta) * s
    return beta * t * (t_lp - m.log()) + (1 - beta) * s * (s_lp - m.log())


@pytest.mark.parametrize("variant, beta", ENTRY)
@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_entry_clip_matches_float64_brute_force_at_every_chunk_size(variant, beta, teacher):
    """sum_v min(d_v, c) and its gradient against autograd through `clamp` on the (B, T, V) terms
    (float64 inputs); chunks of 1, 3 and 100 (the whole sequence, the plain computation) agree;
    the unclipped sum is `full_vocab_divergence`; the flags are the positions with a term above c."""
    x = _inputs(torch.float64, seed=11)
    clip = 0.05
    terms_BTV = _entry_terms(variant, beta, x, teacher)
    assert 0.05 < (terms_BTV[x["mask"]] > clip).double().mean() < 0.6  # the cap acts on some entries, not all

    def reference():
        return torch.where(x["mask"], _entry_terms(variant, beta, x, teacher).clamp(max=clip).sum(-1), 0.0)

    want = _values_and_grads(reference, x)
    for chunk_size in (1, 3, 100):
        clipped = _entry_run(variant, beta, x, clip, teacher, chunk_size)
        got = _values_and_grads(lambda: _entry_run(variant, beta, x, clip, teacher, chunk_size).values_BT, x)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), chunk_size
        full = _run(variant, beta, x, teacher)
        assert torch.allclose(clipped.unclipped_BT, full, rtol=0, atol=1e-12)
        assert torch.equal(clipped.clipped_BT, (terms_BTV > clip).any(-1) & x["mask"])
        assert not clipped.unclipped_BT.requires_grad and clipped.clipped_BT.dtype == torch.bool


@pytest.mark.parametrize("variant, beta", ENTRY)
def test_entry_clip_float32_matches_float64_and_passes_gradcheck(variant, beta):
    x = _inputs(seed=12)
    clip = 0.05
    got = _values_and_grads(lambda: _entry_run(variant, beta, x, clip).values_BT, x)
    want = _values_and_grads(lambda: torch.where(x["mask"], _entry_terms(variant, beta, x).clamp(max=clip).sum(-1), 0.0), x)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5)
    x64 = _inputs(torch.float64, seed=12)

    def fn(hidden, weight):
        return _entry_run(variant, beta, {**x64, "hidden": hidden, "weight": weight}, clip, chunk_size=2).values_BT

    # finite differences; no term of this data sits within gradcheck's step of the cap
    assert torch.autograd.gradcheck(fn, (x64["hidden"].requires_grad_(True), x64["weight"].requires_grad_(True)))


def test_entry_clip_can_go_negative_and_a_large_cap_is_the_divergence():
    """As OPSD's README says, capping the positive terms of a KL leaves the negative ones: a tiny cap
    makes sums negative. Each term of a JSD with 0 < beta < 1 is >= 0 (the log-sum inequality), so
    its capped sum stays in [0, V c]. A cap above every term changes nothing, value or gradient."""
    x = _inputs(torch.float64, seed=13)
    for variant, beta in ENTRY:
        values = _entry_run(variant, beta, x, 1e-4).values_BT[x["mask"]]
        if variant == "jsd" and 0 < beta < 1:
            assert (_entry_terms(variant, beta, x) >= 0).all() and ((values >= 0) & (values <= V * 1e-4 + 1e-15)).all()
        else:
            assert (values < 0).any(), (variant, beta)
        unclipped = _values_and_grads(lambda: _run(variant, beta, x), x)
        large = _values_and_grads(lambda: _entry_run(variant, beta, x, 1e6).values_BT, x)
        for a, b in zip(large, unclipped):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_entry_clip_caps_an_infinite_term_and_keeps_masked_garbage_out():
    """A teacher with -inf where the student has mass: the reverse KL's term is inf, capped at c, and
    gives no gradient (the rest of the position still does). inf/nan on masked positions: exactly 0."""
    x = _inputs(seed=14)
    x["teacher_logits"][0, 3, 4] = -math.inf
    x["hidden"][~x["mask"]] = math.nan
    x["teacher_logits"][~x["mask"]] = math.inf
    clipped = _entry_run("reverse_kl", 0.5, x, 0.05)
    assert clipped.unclipped_BT[0, 3] == math.inf and torch.isfinite(clipped.values_BT).all()
    values, grad_hidden, grad_weight = _values_and_grads(lambda: _entry_run("reverse_kl", 0.5, x, 0.05).values_BT, x)
    assert torch.isfinite(grad_hidden).all() and torch.isfinite(grad_weight).all()
    assert grad_hidden[0, 3].abs().sum() > 0
    off = ~x["mask"]
    assert torch.equal(values[off], torch.zeros(int(off.sum()))) and grad_hidden[off].eq(0).all()
    with pytest.raises(ValueError, match="entry clip"):
        _entry_run("reverse_kl", 0.5, x, 0.0)


def _opsd_generalized_jsd_loss(student_logits, teacher_logits, mask, beta, temperature, token_clip):
    """OPSD's `OPSDTrainer.generalized_jsd_loss` (the OPSD repository's opsd_trainer.py L382-480, read
    at commit 7448751 of its fork louieworth/OPSD), its full-vocabulary path (top_k off), restated line for line: logits over
    the temperature, log_softmax, F.kl_div(input, target, log_target=True) = exp(target)(target -
    input) per entry, the clamp on the (B, T, V) terms, then the sum over masked-in entries over the
    number of masked-in positions ("batchmean")."""
    import torch.nn.functional as F

    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if token_clip is not None:
        jsd = jsd.clamp(max=token_clip)
    jsd = jsd[mask]
    return jsd.sum() / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("token_clip", [None, 0.05])
def test_jsd_is_opsds_generalized_jsd_at_the_same_beta_and_temperature(beta, token_clip):
    """selfopd's 'jsd' at jsd_beta = b is OPSD's loss at beta = b: the mixture m = b t + (1 - b) s,
    b KL(t || m) + (1 - b) KL(s || m), beta 0 forward KL(t || s) and 1 reverse KL(s || t), both
    distributions tempered alike (the trainer divides the student's and the in-process teacher's
    hidden states by rollout.temperature, OPSD both logits by its 1.1). With the per-entry cap
    (clip_per = 'vocabulary_entry') it is OPSD's jsd_token_clip. Value and gradient, float64."""
    x = _inputs(torch.float64, seed=15)
    temperature = 1.1
    teacher_logits = x["teacher_hidden"] @ x["teacher_weight"].T

    def opsd():
        return _opsd_generalized_jsd_loss(x["hidden"] @ x["weight"].T, teacher_logits, x["mask"], beta, temperature, token_clip)

    def selfopd():
        hidden, teacher_hidden = x["hidden"] / temperature, x["teacher_hidden"] / temperature
        kw = dict(teacher_hidden_BTH=teacher_hidden, teacher_weight_VH=x["teacher_weight"], divergence="jsd", beta=beta)
        values = (full_vocab_divergence(hidden, x["weight"], x["mask"], **kw) if token_clip is None
                  else entry_clipped_divergence(hidden, x["weight"], x["mask"], token_clip, **kw).values_BT)
        return masked_mean(values, x["mask"])

    hidden, weight = x["hidden"].requires_grad_(True), x["weight"].requires_grad_(True)
    want, got = opsd(), selfopd()
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got.item(), want.item())
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    if token_clip is not None:  # the cap acts here: without it the loss differs
        assert abs(opsd().item() - _opsd_generalized_jsd_loss(
            (x["hidden"] @ x["weight"].T).detach(), teacher_logits, x["mask"], beta, temperature, None).item()) > 1e-3


# ---- input checks -------------------------------------------------------------------------


def test_bad_inputs_are_refused():
    x = _inputs()
    with pytest.raises(ValueError, match="teacher"):
        full_vocab_divergence(x["hidden"], x["weight"], x["mask"])
    with pytest.raises(ValueError, match="teacher"):
        full_vocab_divergence(x["hidden"], x["weight"], x["mask"], teacher_logits_BTV=x["teacher_logits"], teacher_hidden_BTH=x["teacher_hidden"])
    with pytest.raises(ValueError, match="divergence"):
        full_vocab_divergence(x["hidden"], x["weight"], x["mask"], teacher_logits_BTV=x["teacher_logits"], divergence="tv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        full_vocab_divergence(x["hidden"], x["weight"], x["mask"], teacher_logits_BTV=x["teacher_logits"], chunk_size=0)
    with pytest.raises(ValueError, match="K <= V"):
        topk_reverse_kl(x["hidden"], x["weight"], torch.zeros(B, T, V + 1, dtype=torch.long), torch.zeros(B, T, V + 1), x["mask"])
