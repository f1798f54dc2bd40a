"""Distillation math on hand-built logits: teachers (FedDF, Fed-ET), the KD loss, and the training loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fp_bounds import assert_within, gamma, log_softmax_bound, unit_roundoff
from transformers import LlamaForCausalLM

from fedfusion.devices.energy import train_flops
from fedfusion.train.distill import (
    DistillationLoss,
    Teacher,
    confidence,
    distillation_loss,
    feddf_teacher,
    fedet_teacher,
    fit_vocab,
    forward_flops,
    kd_loss,
)
from fedfusion.train.loop import train_steps
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def assert_logit_average(got: torch.Tensor, logits: list[torch.Tensor], weights: list[float], t: float = 1.0,
                         weight_roundings: int = 0) -> float:
    """``got`` is float32 ``log_softmax(sum_k w_k z_k / t)`` of the float32 ``logits`` ``z_k`` and weights ``w_k``
    (summing to 1), against the value in float64. The average's entries round ``K + 1`` times (the K-term sum, the
    division by the count or ``t``; 0/1 masks exact) plus ``weight_roundings`` in each ``w_k`` (Fed-ET's normalised
    confidences), relative to ``sum |w_k z_k| / t``: that input error ``dz`` moves log_softmax by at most
    ``dz_i + max_j dz_j`` (log-sum-exp is 1-Lipschitz in the max norm), to which log_softmax's own rounding adds
    :func:`fp_bounds.log_softmax_bound`. Returns the worst ratio of difference to bound."""
    z = torch.stack([w * x.double() for w, x in zip(weights, logits)])
    mean = z.sum(0) / t
    dz = gamma(len(logits) + 1 + weight_roundings, torch.float32) * z.abs().sum(0) / t
    bound = log_softmax_bound(mean) + dz + dz.amax(-1, keepdim=True)
    return assert_within(got, F.log_softmax(mean, -1), bound)


def assert_prob_average(got: torch.Tensor, logits: list[torch.Tensor], t: float = 1.0) -> float:
    """``got`` is float32 ``log(mean_k softmax(z_k / t))`` of the float32 ``logits`` (``t`` a power of two: the
    division exact), against the value in float64: each softmax entry is off by a relative ``gamma_{V+4}
    (|x - max| + 1)`` (the shift, exp's 2 ulps, the V-term sum, the division), the mean of K positive terms by
    ``gamma_K`` more, and the log turns the relative error into an absolute one and rounds once (``2u |log q|``: its
    ulp and its own error). Returns the worst ratio of difference to bound."""
    assert math.log2(t).is_integer()
    x = torch.stack([z.double() / t for z in logits])
    p = x.softmax(-1)
    rel = gamma(x.shape[-1] + 4, torch.float32) * ((x - x.amax(-1, keepdim=True)).abs() + 1)
    q = p.mean(0)
    bound = (p * rel).sum(0) / p.sum(0) + gamma(len(logits), torch.float32) \
        + 2 * unit_roundoff(torch.float32) * q.log().abs()
    return assert_within(got, q.log(), bound)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p, log_p, log_q = p_logits.softmax(-1), p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p * (log_p - log_q)).sum(-1).mean()


def kd_bound(student: torch.Tensor, target: torch.Tensor, t: float) -> float:
    """Bound on float32 ``kd_loss(student, target, t)``'s error against the exact value of its float32 inputs: per
    position ``sum_j p_j (l_j - s_j)`` with ``s = log_softmax(student / t)`` off by ``log_softmax_bound`` plus the
    division's rounding (``u |x / t|``, moved at most twice by log_softmax), ``p = exp(l)`` by 2 ulps, the difference
    and product by one rounding each, the sum over V and the mean over the rows by ``gamma_{V+R}``; then ``t^2``."""
    z = (student.detach().double() / t)
    u = unit_roundoff(torch.float32)
    eps_s = log_softmax_bound(z) + 2 * u * z.abs().amax(-1, keepdim=True)
    p, lt = target.double().exp(), target.double()
    terms = p * (lt - torch.log_softmax(z, -1))
    per_row = (p * (eps_s + u * (lt - torch.log_softmax(z, -1)).abs())).sum(-1) \
        + gamma(z.shape[-1] + z.shape[0] + 4, torch.float32) * terms.abs().sum(-1)
    return float(t**2 * per_row.mean() * (1 + 2 * u))


def kd_grad_bound(student: torch.Tensor, target: torch.Tensor, t: float) -> torch.Tensor:
    """Bound on autograd's float32 gradient of ``kd_loss`` against the exact ``t (softmax(x / t) - p_t) / N``:
    softmax's entries off by ``p_s (e^eps - 1)`` (eps: ``kd_bound``'s for log_softmax) plus its own 3 roundings,
    ``p_t = exp(l)`` by 2 ulps, the difference and the scaling by ``t / N`` by one each."""
    z = (student.detach().double() / t)
    u = unit_roundoff(torch.float32)
    eps_s = log_softmax_bound(z) + 2 * u * z.abs().amax(-1, keepdim=True)
    p_s, p_t = torch.softmax(z, -1), target.double().exp()
    err = p_s * (eps_s.expm1() + 3 * u) + 2 * u * p_t + 2 * u * (p_s - p_t).abs()
    return t * err * (1 + 2 * u) / student.shape[0]


@pytest.mark.parametrize("temperature", [1.0, 2.0, 4.0])
def test_kd_is_zero_when_student_equals_teacher(temperature):
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    teacher = feddf_teacher(logits[None], temperature)
    # one teacher's mean is its own logits (x * 1, a sum of one, / 1: exact), so both sides take log_softmax of the
    # same x / T: the same values, and every term of the KL is exactly 0
    assert kd_loss(logits, teacher.log_probs, temperature).item() == 0.0


def test_kd_is_t_squared_times_the_kl_at_temperature_and_its_gradient_is_t_times_q_minus_p():
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(4, 7, generator=gen, requires_grad=True)
    teacher_logits = torch.randn(4, 7, generator=gen)
    for t in (1.0, 3.0):
        target = F.log_softmax(teacher_logits / t, dim=-1)
        loss = kd_loss(student, target, t)
        assert_within(loss, t**2 * _kl(target.double(), student.double() / t), kd_bound(student, target, t))
        (grad,) = torch.autograd.grad(loss, student)
        expected = t * (F.softmax(student.double() / t, -1) - target.double().exp()) / student.shape[0]
        assert_within(grad, expected, kd_grad_bound(student, target, t))
        # a descent step moves the student's distribution towards the teacher's
        assert kd_loss(student - 0.1 * grad, target, t) < loss


def test_kd_mask_averages_only_the_kept_positions():
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen).log_softmax(-1)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    kept = kd_loss(student[mask], teacher[mask])
    # the same per-position terms, summed over the kept ones with the others' exact zeros: twice gamma_P of them
    terms = torch.stack([kd_loss(student[mask][i], teacher[mask][i]) for i in range(int(mask.sum()))]).double()
    bound = 2 * gamma(mask.numel() + 2, torch.float32) * float(terms.abs().mean())
    assert abs(kd_loss(student, teacher, mask=mask).item() - kept.item()) <= bound
    assert kd_loss(student, teacher, mask=torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("average", ["logits", "probs"])
def test_feddf_of_identical_teachers_is_that_teacher(average):
    logits = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(3))
    teacher = feddf_teacher(torch.stack([logits, logits, logits]), 2.0, average)
    if average == "logits":  # (3 z) / 3 rounds: within the float32 bound of log_softmax(z / 2), not equal
        assert_logit_average(teacher.log_probs, [logits] * 3, [1 / 3] * 3, 2.0)
    else:
        assert_prob_average(teacher.log_probs, [logits] * 3, 2.0)
    assert teacher.mask.all()


def test_feddf_averages_logits_or_probabilities_over_valid_teachers():
    gen = torch.Generator().manual_seed(4)
    a, b, c = (torch.randn(3, 6, generator=gen) for _ in range(3))
    assert_logit_average(feddf_teacher(torch.stack([a, b]), 1.0).log_probs, [a, b], [0.5, 0.5])
    assert_prob_average(feddf_teacher(torch.stack([a, b]), 1.0, "probs").log_probs, [a, b])
    # teacher c has nothing at position 0; nobody has anything at position 2
    masks = torch.tensor([[True, True, False], [True, True, False], [False, True, False]])
    teacher = feddf_teacher(torch.stack([a, b, c]), 1.0, masks=masks)
    assert_logit_average(teacher.log_probs[0], [a[0], b[0]], [0.5, 0.5])
    assert_logit_average(teacher.log_probs[1], [a[1], b[1], c[1]], [1 / 3] * 3)
    assert teacher.mask.tolist() == [True, True, False]


def test_confidence_rules_rank_a_peaked_teacher_above_a_flat_one():
    flat, peaked = torch.zeros(10), torch.tensor([5.0] + [0.0] * 9)
    for rule in ("variance", "entropy", "maxprob"):
        c = confidence(torch.stack([flat, peaked]), rule)
        assert c[1] > c[0] >= 0
    # log V - entropy of the uniform: log_softmax's rounding (log_softmax_bound), p = exp(log p) (2 ulps), the V
    # products and their sum, the subtraction: gamma_{V+4} more of log V
    v = flat.numel()
    bound = float(log_softmax_bound(flat).max()) * (1 + 3 * unit_roundoff(torch.float32)) + gamma(v + 4, torch.float32) * math.log(v)
    assert 0.0 <= confidence(flat[None], "entropy").item() <= bound
    # equal probabilities p: their float32 mean is within gamma_{V+1} p of p, so the variance within its square
    assert 0.0 <= confidence(flat[None], "variance").item() <= (gamma(v + 2, torch.float32) / v) ** 2
    with pytest.raises(ValueError, match="confidence 'vibes'"):
        confidence(flat[None], "vibes")


def consensus_weights(logits: torch.Tensor, rule: str, agree: list[int]) -> list[float]:
    """Fed-ET's weights of the agreeing teachers, in float64 from the float32 confidences fedet_teacher computes
    (one function on the same inputs), with its ``1e-12`` floor (a tie-break, part of the map): ``(c_k + 1e-12) /
    sum``. Computed in float32 they round K + 2 times over all K teachers (the floor's float32 value and its add,
    the sum: K - 1, the division); a dissenter's zero weight adds nothing."""
    conf = confidence(logits, rule).double()[agree, 0] + 1e-12
    return (conf / conf.sum()).tolist()


def test_fedet_weights_the_consensus_by_confidence():
    confident = torch.tensor([[4.0, 0.0, 0.0, 0.0]])
    unsure = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    teacher = fedet_teacher(torch.stack([confident, unsure]), 1.0)
    alpha = consensus_weights(torch.stack([confident, unsure]), "variance", [0, 1])
    assert alpha[0] > 0.5  # the confident teacher has the larger say
    assert_logit_average(teacher.log_probs, [confident, unsure], alpha, weight_roundings=4)
    assert not teacher.diverse_mask.any()  # both voted for token 0


def test_fedet_separates_dissenters_into_the_diversity_target():
    # two mildly confident teachers vote token 0, one confident teacher votes token 2
    votes_0 = [torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[2.5, 0.0, 0.0]])]
    votes_2 = torch.tensor([[0.0, 0.0, 3.0]])
    teacher = fedet_teacher(torch.stack([*votes_0, votes_2]), 1.0, rule="maxprob")
    alpha = consensus_weights(torch.stack([*votes_0, votes_2]), "maxprob", [0, 1])
    assert_logit_average(teacher.log_probs, votes_0, alpha, weight_roundings=5)
    assert teacher.diverse_mask.tolist() == [True]
    assert_prob_average(teacher.diverse_log_probs, [votes_2])  # the one dissenter's distribution
    # a single teacher far more confident than the two others together wins the vote
    loud = torch.tensor([[0.0, 0.0, 30.0]])
    flat_0 = [torch.tensor([[0.1, 0.0, 0.0]]), torch.tensor([[0.1, 0.0, 0.0]])]
    assert fedet_teacher(torch.stack([*flat_0, loud]), 1.0).log_probs.argmax(-1).item() == 2


def test_distillation_loss_mixes_kd_diversity_and_lm():
    gen = torch.Generator().manual_seed(5)
    student = torch.randn(2, 3, 6, generator=gen)
    labels = torch.randint(6, (2, 3), generator=gen)
    teacher = Teacher(log_probs=torch.randn(2, 3, 6, generator=gen).log_softmax(-1),
                      diverse_log_probs=torch.randn(2, 3, 6, generator=gen).log_softmax(-1),
                      diverse_mask=torch.ones(2, 3, dtype=torch.bool))
    kd = kd_loss(student, teacher.log_probs)
    div = kd_loss(student, teacher.diverse_log_probs)
    ce = F.cross_entropy(student.reshape(-1, 6), labels.reshape(-1))
    assert distillation_loss(student, labels, teacher)[0].item() == kd.item()  # the same kd_loss, weight 1: bit for bit
    loss, parts = distillation_loss(student, labels, teacher, kd_weight=0.1, diversity_weight=0.5)
    assert parts["kd"] == kd.item() and parts["lm"] == ce.item()  # the same operations on the same values
    # the diversity term runs through the all-ones mask's sum / count, not mean: gamma_{P+2} of the per-position terms
    div_terms = torch.stack([kd_loss(student[i, j], teacher.diverse_log_probs[i, j]) for i in range(2) for j in range(3)])
    assert abs(parts["diversity"] - div.item()) <= 2 * gamma(8, torch.float32) * float(div_terms.double().abs().mean())
    # the float32 mix: the weights' own roundings, 0.5 div (exact), the sums and products: gamma_6 of the magnitudes
    mix = 0.1 * (abs(parts["kd"]) + 0.5 * abs(parts["diversity"])) + 0.9 * abs(parts["lm"])
    want = 0.1 * (parts["kd"] + 0.5 * parts["diversity"]) + 0.9 * parts["lm"]
    assert abs(loss.item() - want) <= gamma(6, torch.float32) * mix
    with pytest.raises(ValueError, match="kd_weight"):
        distillation_loss(student, labels, teacher, kd_weight=1.5)


def test_fit_vocab_pads_with_no_mass_and_cuts_extra_ids():
    logits = torch.randn(2, 5)
    padded = fit_vocab(logits, 7)
    assert padded.shape == (2, 7) and torch.equal(padded[:, :5], logits)
    assert padded.softmax(-1)[:, 5:].max().item() == 0.0
    assert torch.equal(fit_vocab(logits, 3), logits[:, :3]) and torch.equal(fit_vocab(logits, 5), logits)


def test_bad_inputs_name_what_is_wrong():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="temperature"):
        feddf_teacher(logits, 0.0)
    with pytest.raises(ValueError, match="masks shape"):
        feddf_teacher(logits, 1.0, masks=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="average 'median'"):
        feddf_teacher(logits, 1.0, "median")
    with pytest.raises(ValueError, match="differ in shape"):
        kd_loss(torch.randn(3, 5), torch.randn(3, 6))


def test_distil_makes_a_tiny_student_match_a_fixed_teacher():
    torch.manual_seed(0)
    teacher_model = LlamaForCausalLM(tiny_config(hidden=32, inter=64)).eval()
    student = LlamaForCausalLM(tiny_config(hidden=16, inter=32))
    windows = torch.randint(50, (32, 9), generator=torch.Generator().manual_seed(6))
    t_params = sum(p.numel() for p in teacher_model.parameters())

    def teacher_fn(rows):
        teacher = feddf_teacher(teacher_model(input_ids=windows[rows, :-1]).logits[None], 2.0)
        teacher.flops = forward_flops(t_params, rows.numel() * 8)
        return teacher

    def gap():
        with torch.no_grad():
            target = feddf_teacher(teacher_model(input_ids=windows[:, :-1]).logits[None], 2.0)
            return kd_loss(student(input_ids=windows[:, :-1]).logits, target.log_probs, 2.0).item()

    before = gap()
    stats = train_steps(student, windows, steps=30, lr=1e-2, batch_size=8, seed=0, loss=DistillationLoss(teacher_fn, 2.0))
    assert gap() < 0.5 * before
    s_params = sum(p.numel() for p in student.parameters())
    tokens = 30 * 8 * 8
    assert stats.tokens == tokens and len(stats.losses) == 30
    assert stats.flops == pytest.approx(train_flops(s_params, tokens) + 30 * forward_flops(t_params, 64))
    assert stats.seconds > 0 and math.isfinite(stats.loss) and stats.cost() == {
        "flops": stats.flops, "seconds": stats.seconds, "tokens": stats.tokens}
    with pytest.raises(ValueError, match="windows must be"):
        train_steps(student, windows[:, :1], steps=1, lr=1e-3, batch_size=16, seed=0, loss=DistillationLoss(teacher_fn))


def test_kd_weight_zero_is_lm_training_that_runs_and_charges_no_teacher():
    torch.manual_seed(0)
    student = LlamaForCausalLM(tiny_config(hidden=16, inter=32))
    windows = torch.randint(50, (16, 9), generator=torch.Generator().manual_seed(2))

    def teacher_fn(rows):
        raise AssertionError("no teacher may run when kd_weight=0")

    stats = train_steps(student, windows, steps=3, lr=1e-2, batch_size=4, seed=0,
                        loss=DistillationLoss(teacher_fn, kd_weight=0.0))
    s_params = sum(p.numel() for p in student.parameters())
    assert stats.flops == pytest.approx(train_flops(s_params, 3 * 4 * 8)) and "kd" not in stats.parts
    assert stats.loss == pytest.approx(stats.parts["lm"])
    with pytest.raises(ValueError, match="needs a teacher"):
        distillation_loss(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), None, kd_weight=0.5)
