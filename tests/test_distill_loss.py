"""The chunked generalised JSD (`losses.head_generalized_jsd_sum`) against the paper's formula written out on dense
logits, and against TRL 1.16's `DistillationTrainer` loss (`_chunked_divergence_loss`) on the same hidden states,
heads and mask: values and the student's gradients, for beta 0, 0.5 and 1 at temperatures 1 and 0.7. In process."""

import pytest
import torch
from trl.trainer.distillation_trainer import _chunked_divergence_loss

from mmrecipes.vlm.model.losses import head_generalized_jsd_sum

VOCAB, STUDENT_WIDTH, TEACHER_WIDTH = 50, 16, 24  # a teacher wider than its student: only the vocabulary is shared
# 0.3: a mixture that is not symmetric, so the weights of p_s and p_t in it cannot be swapped unseen
CASES = [(beta, temperature) for beta in (0.0, 0.3, 0.5, 1.0) for temperature in (1.0, 0.7)]


def models_and_positions(softcap=None):
    generator = torch.Generator().manual_seed(0)
    student_head = torch.nn.Linear(STUDENT_WIDTH, VOCAB, bias=False)
    teacher_head = torch.nn.Linear(TEACHER_WIDTH, VOCAB, bias=False)
    with torch.no_grad():
        student_head.weight.copy_(torch.randn(VOCAB, STUDENT_WIDTH, generator=generator))
        teacher_head.weight.copy_(torch.randn(VOCAB, TEACHER_WIDTH, generator=generator))
    student = torch.randn(3, 11, STUDENT_WIDTH, generator=generator).requires_grad_()
    teacher = torch.randn(3, 11, TEACHER_WIDTH, generator=generator)
    mask = torch.rand(3, 11, generator=generator) > 0.3
    return student_head, teacher_head, student, teacher, mask


def dense_jsd(student_logits, teacher_logits, mask, beta, temperature):
    """The generalised JSD per position on whole logits, as Agarwal et al. (2024) write it with TRL's mixture
    m = (1 - beta) p_s + beta p_t; its limits at beta 0 and 1 are the forward and reverse KL."""
    p_s = torch.softmax(student_logits / temperature, -1)
    p_t = torch.softmax(teacher_logits / temperature, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        per_position = kl(p_t, p_s)
    elif beta == 1:
        per_position = kl(p_s, p_t)
    else:
        m = (1 - beta) * p_s + beta * p_t
        per_position = beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)
    return (per_position * mask).sum()


def assert_close_to_scale(got, expected):
    """Each gradient within 1e-5 of its largest entry (fp32 softmaxes of logits up to about 20 against float64)."""
    for one, other in zip(got, expected):
        torch.testing.assert_close(one, other.to(one.dtype), rtol=0, atol=1e-5 * other.abs().max().item())


@pytest.mark.parametrize("beta, temperature", CASES)
def test_chunked_equals_the_dense_formula(beta, temperature):
    student_head, teacher_head, student, teacher, mask = models_and_positions()
    chunked = head_generalized_jsd_sum(student, student_head, teacher, teacher_head, mask, beta=beta,
                                       temperature=temperature, num_chunks=4)
    chunked.backward()
    assert teacher_head.weight.grad is None  # the teacher is frozen: no gradient reaches it
    grads = student.grad.clone(), student_head.weight.grad.clone()
    student.grad = student_head.weight.grad = None
    dense = dense_jsd(student_head(student).double(), teacher_head(teacher).double(), mask, beta, temperature)
    dense.backward()
    assert chunked.item() == pytest.approx(dense.item(), rel=1e-5)
    assert_close_to_scale(grads, (student.grad, student_head.weight.grad))


@pytest.mark.parametrize("beta, temperature", CASES)
@pytest.mark.parametrize("softcap", [None, 30.0])  # Gemma's final logit soft-capping on both models
def test_equals_trls_distillation_loss(beta, temperature, softcap):
    student_head, teacher_head, student, teacher, mask = models_and_positions()
    ours = head_generalized_jsd_sum(student, student_head, teacher, teacher_head, mask, beta=beta,
                                    temperature=temperature, student_softcap=softcap, teacher_softcap=softcap)
    ours.backward()
    grads = student.grad.clone(), student_head.weight.grad.clone()
    student.grad = student_head.weight.grad = None
    tokens = int(mask.sum())
    trl, _, counted = _chunked_divergence_loss(student, teacher, student_head.weight, teacher_head.weight.detach(),
                                               mask, beta, num_items_in_batch=tokens, temperature=temperature,
                                               student_final_logit_softcapping=softcap,
                                               teacher_final_logit_softcapping=softcap)
    (trl * tokens).backward()
    assert int(counted) == tokens
    assert ours.item() == pytest.approx(trl.item() * tokens, rel=1e-5)
    assert_close_to_scale(grads, (student.grad, student_head.weight.grad))
