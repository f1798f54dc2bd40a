"""FjORD ordered dropout: nested prefixes are genuine sub-models of the client's model, trained in place."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from fedfusion.models.cnn import FedCNNConfig
from fedfusion.models.families import family_of
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.loop import train_steps
from fedfusion.train.ordered import OrderedDropout, nested_plan, ordered_fractions, ordered_loss
from tests.conftest import tiny_config

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("one_thread")  # and per test: a test elsewhere may have raised the count since import

CONFIGS = {
    "llama": lambda: tiny_config(heads=8, kv_heads=4, hidden=32, inter=48),
    "gpt2": lambda: GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                               eos_token_id=0),
    "cnn": lambda: FedCNNConfig(channels=[8, 16], groups=4, image_size=8),
}


def build(family: str):
    torch.manual_seed(0)
    cfg = CONFIGS[family]()
    return family_of(cfg).build(cfg).eval()


def inputs(family: str) -> dict[str, torch.Tensor]:
    if family == "cnn":
        return {"pixel_values": torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))}
    return {"input_ids": torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))}


def test_fractions_are_the_ladder_below_the_clients_width_relative_to_it():
    assert ordered_fractions(0.5, [0.125, 0.25, 0.5, 1.0]) == (0.25, 0.5, 1.0)
    assert ordered_fractions(0.3, [0.5, 1.0]) == (1.0,)
    with pytest.raises(ValueError, match="max_width"):
        ordered_fractions(0.0, [0.5])
    with pytest.raises(ValueError, match="ladder"):
        ordered_fractions(0.5, [1.5])


def test_server_side_ordered_plan_is_the_static_prefix_and_prefixes_nest():
    cfg = CONFIGS["llama"]()
    axes = ("heads", "neurons", "hidden")
    assert plan_slice(cfg, 0.5, "ordered", server_round=7, axes=axes) == plan_slice(cfg, 0.5, "static", axes=axes)
    plans = [nested_plan(cfg, f, axes) for f in (0.25, 0.5, 0.75, 1.0)]
    for small, big in zip(plans, plans[1:]):
        for axis in axes:
            assert small.units(axis) == big.units(axis)[: len(small.units(axis))]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_nested_forward_is_the_extracted_sub_models_forward(family):
    model = build(family)
    od = OrderedDropout(model, (0.25, 0.5, 1.0), axes=family_of(model.config).default_axes)
    for fraction in (0.25, 0.5):
        plan = od.plans[fraction]
        genuine = family_of(model.config).build(sub_config(model.config, plan)).eval()
        genuine.load_state_dict(extract(model.state_dict(), model.config, plan))
        with torch.no_grad():  # exact: the shell is the genuine sub-model's class on equal (extracted) values
            assert torch.equal(od(fraction, **inputs(family)).logits, genuine(**inputs(family)).logits)
    with torch.no_grad():
        assert torch.equal(od(1.0, **inputs(family)).logits, model(**inputs(family)).logits)


def test_nested_step_trains_only_the_prefix_with_the_scaled_gradient():
    model = build("llama")
    od = OrderedDropout(model, (0.5, 1.0))
    plan = od.plans[0.5]
    genuine = family_of(model.config).build(sub_config(model.config, plan))
    genuine.load_state_dict(extract(model.state_dict(), model.config, plan))
    x = inputs("llama")["input_ids"]
    od(0.5, input_ids=x, labels=x).loss.backward()
    genuine(input_ids=x, labels=x).loss.backward()
    keep, full = list(plan.neurons), model.config.intermediate_size
    up, down = model.model.layers[0].mlp.up_proj.weight.grad, model.model.layers[0].mlp.down_proj.weight.grad
    outside = sorted(set(range(full)) - set(keep))
    assert torch.all(up[outside] == 0) and torch.all(down[:, outside] == 0)
    # exact: the prefix's forward and backward are the genuine sub-model's own on equal values (extract copies them
    # contiguous, functional_call runs the same class), and extract's backward copies the gradient into the prefix
    # (up_proj) or scales it by the scaler (down_proj: one multiplication by the same float as here)
    assert torch.equal(up[keep], genuine.model.layers[0].mlp.up_proj.weight.grad)
    scale = full / len(keep)  # down_proj carries the folded scaler: d/dW = scale * d/d(sub weight)
    assert torch.equal(down[:, keep], scale * genuine.model.layers[0].mlp.down_proj.weight.grad)


def _nested_loss(od: OrderedDropout, fraction: float, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(od(fraction, input_ids=windows[:, :-1], labels=windows[:, :-1]).loss)


@pytest.mark.parametrize("distill", [False, True])
def test_ordered_training_improves_every_width_and_repeats_for_a_seed(distill):
    windows = torch.arange(12).repeat(16, 2)[:, :17] % 5  # a pattern every width can learn
    losses = []
    for _ in range(2):
        model = build("llama")
        probe = OrderedDropout(model, (0.25, 1.0))
        before = [_nested_loss(probe, f, windows) for f in (0.25, 1.0)]
        stats = train_steps(model, windows, steps=25, lr=1e-2, batch_size=8, seed=3,
                            loss=ordered_loss(model, (0.25, 0.5, 1.0), distill=distill, seed=3))
        after = [_nested_loss(probe, f, windows) for f in (0.25, 1.0)]
        assert all(a < 0.7 * b for a, b in zip(after, before)), (before, after)
        assert 0.25 <= stats.parts["mean_fraction"] <= 1.0 and stats.metrics()["mean_fraction"] == stats.parts["mean_fraction"]
        losses.append(stats.loss)
    assert losses[0] == losses[1]


def test_unknown_fraction_is_named():
    od = OrderedDropout(build("llama"), (0.5, 1.0))
    with pytest.raises(ValueError, match="ladder"):
        od(0.3, **inputs("llama"))
