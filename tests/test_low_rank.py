"""Low-rank full-forward windows (fedfusion.models.low_rank): what the server folds is what the device trained."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_within, gamma
from transformers import LlamaForCausalLM

from fedfusion.fusion.base import Client
from fedfusion.fusion.inprocess import SubModelRun, run_submodel
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import config_aliases, model_from_state, wire_state
from fedfusion.models.frozen import FrozenLinear
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
    """The device's model computes each layer as ``x W^T + (x A^T) B^T``, the server's densified target as
    ``x (W + B A)^T``: the same exact function, rounded differently, and through the network's nonlinear chain no
    bound on the logits is worth asserting. So each side is checked against the exact layer, per matrix (fp_bounds):
    the densified matrix within ``gamma_{r+1} (|W| + |B| |A|)`` of ``W + B A``, and each of the device's layers within
    ``gamma_{k+r+1} (|x| |W|^T + |x| |A|^T |B|^T)`` of ``x (W + B A)^T`` on its own input ``x``."""
    cfg, state, factored, exact, data = _setup()
    model = LowRankModel(cfg, state, factored, {n: state[n] for n in exact}, rank=2, seed=5)
    with torch.no_grad():
        assert torch.equal(model(input_ids=data[:, :-1]).logits, model_from_state(cfg, state)(input_ids=data[:, :-1]).logits)
    train_steps(model, data, steps=5, lr=1e-2, batch_size=4, seed=3)
    reply = model.trained()
    dense = densify(reply, state, factored, exact, rank=2)
    moved = max(float((dense[n] - state[n]).abs().max()) for n in factored)
    assert moved > 1e-4  # every matrix's update went through B @ A
    for name in factored:  # the server folds what the device trained
        a, b = reply[name + FACTOR_A], reply[name + FACTOR_B]
        exact_w = state[name].double() + b.double() @ a.double()
        bound = gamma(a.shape[0] + 1, torch.float32) * (state[name].double().abs() + b.double().abs() @ a.double().abs())
        assert_within(dense[name], exact_w, bound)
    seen = []
    for name, m in model.target().named_modules():
        if isinstance(m, FrozenLinear):
            m.register_forward_hook(lambda _, args, y, name=name: seen.append((f"{name}.weight", args[0], y)))
    with torch.no_grad():  # the device's layers compute the densified target's
        model(input_ids=data[:, :-1])
    assert {name for name, _, _ in seen} == {n for n in factored if n != "model.embed_tokens.weight"}
    for name, x, y in seen:
        x, a, b = x.reshape(-1, x.shape[-1]).double(), reply[name + FACTOR_A].double(), reply[name + FACTOR_B].double()
        w = state[name].double()
        bound = gamma(x.shape[1] + a.shape[0] + 1, torch.float32) * (x.abs() @ w.abs().T + x.abs() @ a.abs().T @ b.abs().T)
        assert_within(y.reshape(len(x), -1), x @ (w + b @ a).T, bound)
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
    # against the exact fold: float32 roundings of at most the r-term products, the weights, the sum, the division
    # and the addition to the target: gamma_{r+4} of the magnitudes summed (gamma_3 for the exact tensors' mean)
    for name in factored:
        delta = [r[name + FACTOR_B].double() @ r[name + FACTOR_A].double() for r in replies]
        size = [r[name + FACTOR_B].double().abs() @ r[name + FACTOR_A].double().abs() for r in replies]
        rank = replies[0][name + FACTOR_A].shape[0]
        bound = gamma(rank + 4, torch.float32) * (state[name].double().abs() + (1 * size[0] + 3 * size[1]) / 4)
        assert_within(new[name], state[name].double() + (1 * delta[0] + 3 * delta[1]) / 4, bound)
    for name in exact:
        r0, r1 = replies[0][name].double(), replies[1][name].double()
        assert_within(new[name], (1 * r0 + 3 * r1) / 4, gamma(3, torch.float32) * (1 * r0.abs() + 3 * r1.abs()) / 4)


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
