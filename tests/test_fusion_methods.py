"""The fusion methods on plain tensors, without Flower: payloads, checks, folds, a mixed round's fold order and the
in-process driver; and the import layering the methods rely on (no Flower in them, no client role on the server)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from fp_bounds import assert_within
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.data.text import build_char_tokenizer
from fedfusion.fusion.base import Client, FusionMethod
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.distill.method import DistillMethod, Family
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.method import GenerativeMethod
from fedfusion.fusion.generative.reply import SAMPLES_KEY
from fedfusion.fusion.inprocess import Rounds, run_rounds
from fedfusion.fusion.lora.aggregate import ClientLoRA, aggregate_lora
from fedfusion.fusion.lora.method import LoRAMethod, split_global
from fedfusion.fusion.lora.spec import LoRABaseSpec
from fedfusion.fusion.rounds import FOLD_ORDER, client_seed, fold_order, fold_round, round_payloads
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.slicing import SelectiveAverager
from tests.conftest import tiny_config
from tests.test_lora import ROUNDINGS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

ROOT = Path(__file__).resolve().parents[1]
CHAR = build_char_tokenizer()
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York.\n" * 8


def _target(cfg=None) -> tuple[LlamaConfig, dict]:
    cfg = cfg or tiny_config()
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).state_dict()


def _clients(tiers: dict[int, str], rnd: int = 1) -> list[Client]:
    return [Client(p, tier, client_seed(0, rnd, p)) for p, tier in tiers.items()]


def _shifted(state: dict, by: float) -> dict:
    return {k: v + by for k, v in state.items()}


def test_submodel_payloads_are_staggered_slices_and_the_fold_is_the_selective_average():
    cfg, state = _target()
    method = SubModelMethod(cfg, {"phone": 0.25, "laptop": 0.5}, state, policy="rolling", stride=0.25, stagger=True)
    payloads = method.payloads(3, state, _clients({4: "phone", 7: "laptop", 9: "phone"}, 3))
    plans = [p.context[0] for p in payloads]
    units = [u for plan in plans for u in plan.neurons]
    assert len(units) == len(set(units)) == 48  # 0.25 + 0.5 + 0.25 of 48 neurons, end to end
    assert [p.width for p in payloads] == [0.25, 0.5, 0.25] and all(p.spec["role"] == "submodel" for p in payloads)
    assert [p.params for p in payloads] == [sum(t.numel() for t in p.arrays.values()) for p in payloads]
    shifts = (0.1, -0.2, 0.3)
    updates = [method.check(p, _shifted(p.arrays, s), 1.0) for p, s in zip(payloads, shifts)]
    folded = method.fold(3, state, updates)
    want = SelectiveAverager(state, cfg)
    for p, s in zip(payloads, shifts):
        want.add(_shifted(p.arrays, s), p.context[0])
    for k, v in want.result().items():  # exact: fold is this averager's adds, in this order, at weight 1.0
        assert torch.equal(folded.target[k], v)
    assert folded.coverage == want.coverage() and method.tier_cost("laptop").width == 0.5


@pytest.mark.parametrize("breakage", ["nan", "missing", "shape"])
def test_submodel_check_refuses_a_broken_reply_by_name(breakage):
    cfg, state = _target()
    method = SubModelMethod(cfg, {"phone": 0.5}, state, policy="static")
    payload = method.payloads(1, state, _clients({0: "phone"}))[0]
    reply = _shifted(payload.arrays, 0.0)
    key = "model.layers.0.mlp.up_proj.weight"
    if breakage == "nan":
        reply[key][0, 0] = float("nan")
    elif breakage == "missing":
        del reply[key]
    else:
        reply[key] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match={"nan": "NaN", "missing": "missing", "shape": "shape"}[breakage]):
        method.check(payload, reply, 1.0)


def test_lora_fold_is_the_exact_heterogeneous_aggregate_and_a_wrong_rank_is_refused():
    modules = {"a.q_proj": (12, 10), "a.v_proj": (6, 10)}
    method = LoRAMethod(modules, {"phone": 2, "desktop": 4}, {"phone": 4.0, "desktop": 8.0}, {}, "zeropad",
                        base_params=1000, base=LoRABaseSpec("unused", "float32", ("q_proj", "v_proj"), 0.0))
    payloads = method.payloads(1, {}, _clients({0: "phone", 1: "desktop"}))
    assert [p.row["rank"] for p in payloads] == [2, 4] and method.tier_cost("desktop").nbytes == 4 * 4 * (22 + 16)
    g = torch.Generator().manual_seed(0)
    replies = [{k: torch.randn(v.shape, generator=g) for k, v in p.arrays.items()} for p in payloads]
    updates = [method.check(p, r, w) for p, r, w in zip(payloads, replies, (1.0, 3.0))]
    A, B = split_global(method.fold(1, {}, updates).target)
    want = aggregate_lora([u.data for u in updates], "zeropad")
    for m in modules:  # both float32 roundings of the float64 aggregate: twice tests/test_lora.py's ROUNDINGS
        got, size = B[m].double() @ A[m].double(), B[m].double().abs() @ A[m].double().abs()
        assert_within(got, want.delta[m], 2 * ROUNDINGS * size)
    with pytest.raises(ValueError, match=r"expected \(2, 10\)"):
        method.check(payloads[0], replies[1], 1.0)
    assert isinstance(updates[0].data, ClientLoRA) and updates[1].norm > 0


def _distill(cfg: LlamaConfig, tiers: dict[str, str]) -> DistillMethod:
    family = LlamaConfig(vocab_size=len(CHAR), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    settings = DistillConfig(server_steps=2, server_batch_size=2, back_steps=1)
    return DistillMethod(cfg, CHAR, {"tiny": Family(family)}, tiers, TEXT, 16, settings)


def _char_target() -> tuple[LlamaConfig, dict]:
    return _target(LlamaConfig(vocab_size=len(CHAR), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, head_dim=4, max_position_embeddings=64,
                               tie_word_embeddings=False))


def test_distill_averages_each_family_then_distils_it_into_the_target_and_charges_the_server():
    cfg, state = _char_target()
    method = _distill(cfg, {"phone": "tiny"})
    payloads = method.payloads(1, state, _clients({0: "phone", 1: "phone"}))
    sent = payloads[0].arrays
    updates = [method.check(p, _shifted(p.arrays, s), 1.0) for p, s in zip(payloads, (0.01, 0.03))]
    folded = method.fold(1, state, updates)
    assert folded.coverage == 1.0 and folded.server_cost["flops"] > 0 and "distill_loss" in folded.stats
    assert any(not torch.equal(folded.target[k], state[k]) for k in state)
    assert method.trained == {"tiny"} and any(not torch.equal(method.family_states["tiny"][k], sent[k] + 0.02)
                                              for k in sent)  # FedAvg, then moved by back-distillation
    with pytest.raises(ValueError, match="shape"):
        method.check(payloads[0], {**sent, next(iter(sent)): torch.zeros(2)}, 1.0)


def test_generative_server_state_keeps_each_devices_model_and_trains_the_target_on_its_samples():
    cfg, state = _target()
    method = GenerativeMethod(cfg, {"phone": 0.5}, state, GenerativeConfig(sample_fraction=1.0, server_steps=2,
                                                                           server_batch=2, device_state="server"),
                              seq_len=8, population=4)
    payload = method.payloads(1, state, [Client(2, "phone", 5, {"examples": 3})])[0]
    assert payload.spec["samples"] == 3 and payload.spec["role"] == "generative"
    with pytest.raises(ValueError, match=SAMPLES_KEY):
        method.check(payload, dict(payload.arrays), 1.0)
    own = _shifted(payload.arrays, 0.01)
    update = method.check(payload, {**own, SAMPLES_KEY: torch.randint(0, 50, (3, 9))}, 1.0)
    folded = method.fold(1, state, [update])
    assert folded.server_cost["tokens"] == 2 * 2 * 8 and any(not torch.equal(folded.target[k], state[k]) for k in state)
    again = method.payloads(2, folded.target, [Client(2, "phone", 6, {"examples": 3})])[0]
    assert all(torch.equal(again.arrays[k], own[k]) for k in own)  # its own model back, not a fresh slice


def _mixed(cfg: LlamaConfig, state: dict) -> dict[str, FusionMethod]:
    sub = SubModelMethod(cfg, {"laptop": 0.5}, state, policy="rolling", stride=0.5)
    distill = _distill(cfg, {"phone": "tiny"})
    return {"laptop": sub, "phone": distill}


def test_a_mixed_round_folds_slices_first_then_distils_into_their_average():
    cfg, state = _char_target()
    methods = _mixed(cfg, state)
    assert [m.name for m in fold_order(methods)] == ["submodel", "distill"] and FOLD_ORDER.index("submodel") == 0
    clients = _clients({0: "phone", 1: "laptop", 2: "phone", 3: "laptop"})
    payloads = round_payloads(methods, 1, state, clients)
    assert [p.client.partition for p in payloads] == [0, 1, 2, 3]  # sample order, whatever the method
    updates = [methods[p.client.tier].check(p, _shifted(p.arrays, 0.01 * (i + 1)), 1.0) for i, p in enumerate(payloads)]
    folded = fold_round(methods, 1, state, updates)
    # the same round by hand, on fresh method objects: the slice average, then distillation into it
    fresh = _mixed(cfg, state)
    by_hand = fresh["laptop"].fold(1, state, [u for u in updates if u.payload.client.tier == "laptop"]).target
    by_hand = fresh["phone"].fold(1, by_hand, [u for u in updates if u.payload.client.tier == "phone"]).target
    for k, v in by_hand.items():  # exact: the same folds in the same order on equal inputs, seeded alike
        assert torch.equal(folded.target[k], v)
    assert folded.server_cost["flops"] > 0 and folded.coverage == 1.0


def test_the_driver_runs_a_mixed_federation_with_the_seeds_the_strategy_uses():
    cfg, state = _char_target()
    methods = _mixed(cfg, state)
    seen = []

    def train(rnd, payload):
        seen.append((rnd, payload.client.partition, payload.client.seed, payload.spec["role"]))
        return _shifted(payload.arrays, 0.01), {"train_s": 0.0, "train_tokens": 8, "num-examples": 4}

    target, stats = run_rounds(methods, ["phone", "laptop", None, "laptop"], state, train,
                               Rounds(rounds=2, per_round=4, seed=0))
    assert [s[:2] for s in seen] == [(r, p) for r in (1, 2) for p in (0, 1, 3)]  # partition 2 never trains
    assert all(seed == client_seed(0, rnd, p) for rnd, p, seed, _ in seen)
    assert {role for *_, role in seen} == {"smallmodel", "submodel"} and stats.client_rounds == 6
    assert stats.server_flops > 0 and any(not torch.equal(target[k], state[k]) for k in state)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_methods_import_no_flower_and_the_server_no_client_role():
    # every package below the run (the methods, the round engine and in-process driver, the wire, ...) is Flower-free
    flower_free = [path for package in ("config", "wire", "devices", "data", "models", "train", "fusion", "selection",
                                        "phone") for path in sorted((ROOT / "fedfusion" / package).rglob("*.py"))]
    assert len(flower_free) > 50
    for path in flower_free:
        assert not {n for n in _imports(path) if n.split(".")[0] == "flwr"}, path
    server = [ROOT / "fedfusion" / "server_app.py", *sorted((ROOT / "fedfusion" / "run").glob("*.py")),
              *sorted((ROOT / "strategies").glob("*.py"))]
    for path in server:
        assert not {n for n in _imports(path) if n.startswith("fedfusion.clients")}, path
    targets = ROOT / "fedfusion" / "run" / "targets.py"
    assert not {n for n in _imports(targets) if n.startswith("fedfusion.strategies")}


def test_state_norm_is_the_norm_of_every_value_together_within_float32_rounding() -> None:
    """state_norm (what a reply's norm is judged by, ``max_norm_ratio``) against the float64 norm of all values at
    once: each tensor's sum of squares (n terms, each squared: gamma_{n+1} relative), its root, the roots' sum of
    squares over k tensors and the last root add up to within gamma_{n + k + 4} of the exact norm; integers count as
    their values, a NaN anywhere makes it NaN."""
    from fp_bounds import gamma

    from fedfusion.fusion.base import state_norm
    gen = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(300, 70, generator=gen) * 40, "b": torch.randn(70, generator=gen).half(),
             "ids": torch.arange(9) * 1000}
    exact = float(torch.cat([t.double().flatten() for t in state.values()]).norm())
    got = state_norm(state)
    assert abs(got - exact) <= gamma(300 * 70 + len(state) + 4, torch.float32) * exact
    assert abs(state_norm({k: v for k, v in state.items() if k != "ids"}) - exact) > 0.1 * exact  # every one counts
    assert math.isnan(state_norm({**state, "b": torch.tensor([float("nan")])})) and state_norm({}) == 0.0
