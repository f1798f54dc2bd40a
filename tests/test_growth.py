"""Function-preserving growth (fedfusion.models.growth): the grown target computes what the small model computes."""

from __future__ import annotations

import math

import pytest
import torch
from fp_bounds import assert_within, gamma
from model_bounds import float64_norms, output_bound
from transformers import GPT2Config, LlamaConfig, OPTConfig

from fedfusion.models.families import family_of
from fedfusion.models.growth import grow
from fedfusion.models.slicing import axis_sizes, plan_slice, sub_config
from fedfusion.train.loop import train_steps


def llama(tied: bool = True) -> LlamaConfig:
    return LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=8, tie_word_embeddings=tied, max_position_embeddings=32)


def gpt2() -> GPT2Config:
    return GPT2Config(vocab_size=40, n_embd=32, n_layer=4, n_head=4, n_inner=64, n_positions=32,
                      bos_token_id=0, eos_token_id=0)


def opt() -> OPTConfig:
    return OPTConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_dim=64,
                     word_embed_proj_dim=32, max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=0)


def trained_small(config, plan, seed: int = 0):
    """A sub-model of ``plan`` whose weights are far from any initialisation (as after training)."""
    torch.manual_seed(seed)
    small = family_of(config).build(sub_config(config, plan))
    with torch.no_grad():
        for p in small.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return small.eval()


CASES = [
    (llama(), 0.25, ("heads", "neurons")),
    (llama(), 0.25, ("heads", "neurons", "hidden")),
    (llama(tied=False), 0.25, ("heads", "neurons", "hidden")),
    (llama(), 0.5, ("heads", "neurons", "hidden", "depth")),
    (gpt2(), 0.25, ("neurons", "depth")),
    (opt(), 0.5, ("neurons", "depth")),
]


def example_losses(model: torch.nn.Module):
    """Each example's mean next-token loss, as a column (what :func:`output_bound` bounds entry by entry): their mean
    is the batch loss ``model(input_ids=ids, labels=ids).loss`` when every example has the same length."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1, keepdim=True)
    return run


@pytest.mark.parametrize(("config", "width", "axes"), CASES, ids=lambda c: getattr(c, "model_type", str(c)))
def test_the_grown_target_computes_the_small_models_logits(config, width, axes):
    """In float64 (the norms too: model_bounds.float64_norms), where growth is an identity of the algebra: the grown
    target's logits are the small model's to float64 rounding wherever growth's factor ``sqrt(N / n)`` is a power of
    two: each model's logits within model_bounds.output_bound of the exact ones (every product's and norm's
    ``gamma_k`` error carried to each logit by that logit's own derivatives, doubled for the ops between), so the two
    within the sum of their bounds (about 1e-12 of the logits; a unit growth misplaced moves them by its share).
    Otherwise growth stages each value in float32 (``stage_update``) and rounds its scaling there: each grown weight
    within ``gamma_3 |w|`` of the exact one, which moves the loss by at most ``gamma_3 sum |dL/dw| |w|`` to first order
    (checked, with each float64 loss's own bound beside it; the logits of a network have no such one-line bound). In float32 the grown
    target's longer sums (the zeros growth adds) round differently through norms and softmax: no bound there."""
    plan = plan_slice(config, width, "static", axes=axes)
    small = float64_norms(trained_small(config, plan).double())
    torch.manual_seed(1)
    target = float64_norms(family_of(config).build(config).eval().double())
    target.load_state_dict(grow(small.state_dict(), config, plan, target.state_dict()))
    ids = torch.randint(0, config.vocab_size, (2, 12))  # each logit's bound takes a backward: a short batch
    with torch.no_grad():
        want, got = small(input_ids=ids).logits, target(input_ids=ids).logits
    assert want.abs().max() > 0.5  # a model that says something, so equality is not trivial
    ratio = axis_sizes(config)["hidden"] / len(plan.hidden) if "hidden" in axes else 1.0
    if math.log(ratio, 4).is_integer():  # sqrt(N / n) a power of two: growth's arithmetic is exact
        bound = output_bound(lambda v: small(input_ids=v).logits, ids, small) \
            + output_bound(lambda v: target(input_ids=v).logits, ids, target)
        assert bound.max() < 1e-9 * want.abs().max()  # a bound that could fail
        assert_within(got, want, bound)
    loss = target(input_ids=ids, labels=ids).loss
    loss.backward()
    sensitivity = sum(float((p.grad * p.detach()).abs().sum()) for p in target.parameters() if p.grad is not None)
    with torch.no_grad():
        small_loss = small(input_ids=ids, labels=ids).loss
    # each float64 loss off its exact value by at most its own bound: the mean of the examples' losses (the
    # same count of tokens in each), each within output_bound, plus the mean's own n roundings
    rounding = sum(float(output_bound(example_losses(m), ids, m).mean()) + gamma(ids.numel(), torch.float64) * float(v)
                   for m, v in ((small, small_loss), (target, loss)))
    assert rounding < 1e-9 * float(small_loss)  # float64's share: small beside the float32 staging's term
    assert abs(float(loss) - float(small_loss)) <= gamma(3, torch.float32) * sensitivity + rounding
    assert sum(p.numel() for p in target.parameters()) > 1.5 * sum(p.numel() for p in small.parameters())


def test_new_units_do_not_stay_silent_or_identical_after_a_step():
    config = llama()
    plan = plan_slice(config, 0.25, "static", axes=("heads", "neurons"))
    torch.manual_seed(1)
    target = family_of(config).build(config)
    target.load_state_dict(grow(trained_small(config, plan).state_dict(), config, plan, target.state_dict()))
    down = target.model.layers[0].mlp.down_proj.weight
    kept = len(plan.neurons)
    assert down[:, kept:].abs().max() == 0  # the new neurons start silent
    train_steps(target, torch.randint(0, config.vocab_size, (16, 17)), steps=2, lr=1e-2, batch_size=8, seed=0)
    new = down[:, kept:].detach()
    assert (new.abs().sum(0) > 0).all()  # every new neuron now writes to the residual stream
    assert torch.cdist(new.T, new.T).fill_diagonal_(1.0).min() > 0  # and no two of them write the same thing


def test_a_layernorm_family_refuses_to_grow_its_hidden_dims():
    config = gpt2()
    plan = plan_slice(config, 0.5, "static", axes=("heads", "hidden"))
    small = trained_small(config, plan)
    with pytest.raises(ValueError, match="gpt2 model normalises with LayerNorm"):
        grow(small.state_dict(), config, plan, family_of(config).build(config).state_dict())


def test_a_small_model_of_another_plan_is_refused_naming_its_keys():
    config = llama()
    plan = plan_slice(config, 0.25, "static", axes=("heads", "neurons", "depth"))
    other = plan_slice(config, 0.25, "static", axes=("heads", "neurons"))
    with pytest.raises(ValueError, match="missing|extra"):
        grow(trained_small(config, other).state_dict(), config, plan, family_of(config).build(config).state_dict())
    wrong = plan_slice(config, 0.5, "static", axes=("heads", "neurons"))
    with pytest.raises(ValueError, match="has shape"):
        grow(trained_small(config, wrong).state_dict(), config, other, family_of(config).build(config).state_dict())
