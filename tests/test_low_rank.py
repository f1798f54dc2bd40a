"""Low-rank full-forward windows (fedfusion.models.low_rank): what the server folds is what the device trained."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from fedfusion.fusion.base import Client
from fedfusion.fusion.inprocess import SubModelRun, run_submodel
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import config_aliases, model_from_state, wire_state
from fedfusion.models.full_forward import from_payload
from fedfusion.models.low_rank import FACTOR_A, FACTOR_B, LowRankModel, densify, factor_params, split
from fedfusion.train.loop import evaluate_lm, train_steps
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import Wire, decode
from fedfusion.wire.specs import WindowSpec
from tests.conftest import tiny_config


def _setup(shared: bool = False):
    cfg = tiny_config()
    torch.manual_seed(0)
    state = wire_state(LlamaForCausalLM(cfg).state_dict(), config_aliases(cfg))
    factored, exact = split(cfg, state, shared)
    data = torch.randint(3, cfg.vocab_size, (16, 9), generator=torch.Generator().manual_seed(1))
    return cfg, state, factored, exact, data


@pytest.mark.parametrize("shared", [False, True])
def test_split_factors_every_matrix_and_trains_small_tensors_exactly(shared):
    cfg, state, factored, exact, _ = _setup(shared)
    embed = "model.embed_tokens.weight"
    assert (embed in exact) == shared and (embed in factored) != shared
    assert all(state[n].dim() == 2 for n in factored)
    assert any(n.endswith("norm.weight") for n in exact) and not any(n.endswith("norm.weight") for n in factored)
    assert sorted(factored + exact) == sorted(state)


def test_the_model_starts_as_the_target_and_its_reply_densifies_to_what_it_trained():
    cfg, state, factored, exact, data = _setup()
    model = LowRankModel(cfg, state, factored, {n: state[n] for n in exact}, rank=2, seed=5)
    with torch.no_grad():
        assert torch.equal(model(input_ids=data[:, :-1]).logits, model_from_state(cfg, state)(input_ids=data[:, :-1]).logits)
    train_steps(model, data, steps=5, lr=1e-2, batch_size=4, seed=3)
    reply = model.trained()
    dense = densify(reply, state, factored, exact, rank=2)
    moved = max(float((dense[n] - state[n]).abs().max()) for n in factored)
    assert moved > 1e-4  # every matrix's update went through B @ A
    with torch.no_grad():  # the server's densified target computes what the device's model computes
        want = model(input_ids=data[:, :-1]).logits
        got = model_from_state(cfg, dense)(input_ids=data[:, :-1]).logits
    assert torch.allclose(want, got, atol=1e-5)
    assert sum(v.numel() for v in reply.values()) == factor_params(state, factored, 2) + sum(state[n].numel() for n in exact)


def test_densify_names_the_bad_key():
    cfg, state, factored, exact, _ = _setup()
    reply = LowRankModel(cfg, state, factored, {n: state[n] for n in exact}, rank=2, seed=5).trained()
    name = factored[0]
    with pytest.raises(ValueError, match="missing"):
        densify({k: v for k, v in reply.items() if k != name + FACTOR_A}, state, factored, exact, rank=2)
    with pytest.raises(ValueError, match=name):
        densify({**reply, name + FACTOR_B: torch.zeros(3, 3)}, state, factored, exact, rank=2)
    with pytest.raises(ValueError, match="non-finite"):
        densify({**reply, name + FACTOR_B: torch.full_like(reply[name + FACTOR_B], float("nan"))}, state, factored,
                exact, rank=2)


def test_the_fold_is_the_target_plus_the_weighted_mean_of_the_devices_updates():
    """FLoRA-exact: the server averages each device's B @ A, not the factors."""
    cfg, state, factored, exact, data = _setup()
    method = SubModelMethod(cfg, {"t": 0.5}, state, forward="full", frozen="float32", window_rank=2, scale=False)
    clients = [Client(partition=i, tier="t", seed=10 + i) for i in range(2)]
    payloads = method.payloads(1, state, clients)
    updates, replies = [], []
    for payload, weight in zip(payloads, (1.0, 3.0)):
        spec = WindowSpec.from_config(payload.spec)
        assert spec.rank == 2 and all(k.startswith(FROZEN) or k in exact for k in payload.arrays)
        model = from_payload(cfg, decode(payload.arrays), spec, payload.client.seed)
        train_steps(model, data, steps=3, lr=1e-2, batch_size=4, seed=payload.client.seed)
        replies.append(model.trained())
        updates.append(method.check(payload, replies[-1], weight))
    new = method.fold(1, state, updates).target
    for name in factored:
        delta = [r[name + FACTOR_B] @ r[name + FACTOR_A] for r in replies]
        assert torch.allclose(new[name], state[name] + (1 * delta[0] + 3 * delta[1]) / 4, atol=1e-6), name
    for name in exact:
        assert torch.allclose(new[name], (1 * replies[0][name] + 3 * replies[1][name]) / 4, atol=1e-6), name


def test_low_rank_rounds_after_growth_lower_the_loss_and_send_less_up_than_down():
    cfg = tiny_config()
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(3, cfg.vocab_size, (12, 9), generator=gen) for _ in range(3)]
    run = SubModelRun(cfg, windows, [0.5] * 3, policy="rolling", stagger=False, rounds=4, per_round=3, steps=4,
                      lr=0.02, batch_size=4, grow_round=2, forward="full", frozen="int8", window_rank=2)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    fused, stats = run_submodel(run, state, lambda s, rnd: seen.setdefault(rnd, dict(s)) and None)
    held = torch.cat(windows)
    before = evaluate_lm(model_from_state(cfg, seen[2]), held)["eval_loss"]
    assert evaluate_lm(model_from_state(cfg, fused), held)["eval_loss"] < before
    assert stats.bytes_down > stats.bytes_up


def test_a_rank_needs_the_full_forward_and_a_float32_uplink():
    cfg, state, *_ = _setup()
    with pytest.raises(ValueError, match="full forward"):
        SubModelMethod(cfg, {"t": 0.5}, state, window_rank=2)
    with pytest.raises(ValueError, match="float32"):
        SubModelMethod(cfg, {"t": 0.5}, state, forward="full", window_rank=2, wire=Wire(up="int8"))
