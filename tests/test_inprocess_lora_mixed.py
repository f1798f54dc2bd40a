"""The in-process LoRA and mixed-method loops (what benchmarks/privacy.py measures LoRA and mixed federations
with): a round is the clients' own training, folded by the method objects the Flower strategy uses."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_within
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.fusion import inprocess
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.distill.method import DistillMethod, Family
from fedfusion.fusion.inprocess import SubModelRun, run_mixed
from fedfusion.fusion.lora.inprocess import LoRARun, run_lora, with_update
from fedfusion.fusion.lora.method import split_global
from fedfusion.fusion.lora.spec import AdapterSpec
from fedfusion.train.adapter import AdapterSetting, train_adapter
from fedfusion.train.loop import evaluate_lm
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import RoleSpec
from tests.conftest import tiny_config
from tests.test_fusion_methods import CHAR, TEXT
from tests.test_lora import ROUNDINGS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def _base_and_windows(clients: int, vocab: int | None = None):
    cfg = tiny_config()
    cfg.vocab_size = vocab or cfg.vocab_size
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    return cfg, base, [torch.randint(3, cfg.vocab_size, (12, 9), generator=gen) for _ in range(clients)]


def _watch(monkeypatch) -> list[tuple]:
    """Every (payload, reply) the driver's clients return, in order (the driver wrapped by its module name, as
    benchmarks/privacy.py reads the replies)."""
    seen: list[tuple] = []
    original = inprocess.run_rounds

    def wrapped(methods, tiers, initial, train, rounds, evaluate=None, weighting="uniform", caps=None):
        def watched(rnd, payload):
            reply, metrics = train(rnd, payload)
            seen.append((rnd, payload, reply))
            return reply, metrics
        return original(methods, tiers, initial, watched, rounds, evaluate, weighting, caps)

    monkeypatch.setattr(inprocess, "run_rounds", wrapped)
    return seen


def test_one_lora_client_round_is_its_own_adapter_training_and_the_global_update_is_that_adapter(monkeypatch):
    _, base, windows = _base_and_windows(1)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    seen = _watch(monkeypatch)
    run = LoRARun(base=base, windows=windows, tiers=["phone"], ranks={"phone": 2}, alpha=4.0, method="fedavg",
                  rounds=1, per_round=1, steps=3, lr=0.01, batch_size=4)
    update, stats = run_lora(run)
    (_, payload, reply), = seen
    spec = AdapterSpec.from_config(payload.spec)
    own, _ = train_adapter(base, decode(payload.arrays), windows[0], AdapterSetting(2, 4.0, run.modules),
                           payload.client.seed, steps=3, lr=0.01, batch_size=4)
    assert (spec.rank, spec.alpha) == (2, 4.0) and list(own) == list(reply)
    assert all(torch.equal(own[k], reply[k]) for k in own)  # the same seeded training, bit for bit
    A, B = split_global(update)
    for m in A:  # fedavg of one client: its A, and its B times alpha / rank (2.0, exact), up to the mean's roundings
        a, b = reply[f"{m}.lora_A"], reply[f"{m}.lora_B"]
        assert_within(A[m], a, ROUNDINGS * a.abs())
        assert_within(B[m], 2.0 * b, ROUNDINGS * 2.0 * b.abs())
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # the base is left as it was
    assert stats.client_rounds == 1 and stats.tokens == 3 * 4 * 8


def test_a_hetero_rank_lora_run_lowers_the_clients_loss_is_seeded_and_leaves_the_base_unchanged():
    _, base, windows = _base_and_windows(4)
    pooled = torch.cat(windows)
    plain = evaluate_lm(base, pooled)["eval_loss"]
    run = LoRARun(base=base, windows=windows, tiers=["phone", "laptop"] * 2, ranks={"phone": 2, "laptop": 4},
                  modules=("q_proj", "v_proj", "down_proj"), rounds=3, per_round=3, steps=5, lr=0.02, batch_size=4)
    update, _ = run_lora(run)
    again, _ = run_lora(run)
    assert set(update) == set(again) and all(torch.equal(update[k], again[k]) for k in update)
    with with_update(base, update) as model:
        tuned = evaluate_lm(model, pooled)["eval_loss"]
    assert tuned < plain and evaluate_lm(base, pooled)["eval_loss"] == plain
    with with_update(base, {}) as model:  # no update yet: the base itself
        assert evaluate_lm(model, pooled)["eval_loss"] == plain


def _families(cfg) -> DistillMethod:
    family = LlamaConfig(vocab_size=len(CHAR), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return DistillMethod(cfg, CHAR, {"tiny": Family(family)}, {"phone": "tiny"}, TEXT, 16,
                         DistillConfig(server_steps=2, server_batch_size=2, back_steps=1))


def test_a_mixed_run_trains_phones_families_and_the_others_slices_and_folds_both(monkeypatch):
    cfg, base, windows = _base_and_windows(4, vocab=len(CHAR))
    initial = base.state_dict()
    tiers = ["phone", "laptop", "phone", "laptop"]
    run = SubModelRun(cfg, windows, [0.25, 0.5, 0.25, 0.5], rounds=2, per_round=4, steps=2, lr=0.01, batch_size=4)
    families = _families(cfg)
    seen = _watch(monkeypatch)
    target, stats = run_mixed(run, tiers, families, initial)
    roles = {(payload.client.tier, RoleSpec.from_config(payload.spec).role) for _, payload, _ in seen}
    assert roles == {("phone", "smallmodel"), ("laptop", "submodel")}
    family_keys = set(families.family_states["tiny"])
    for _, payload, reply in seen:  # a phone replies its family model, a laptop its slice
        assert (set(reply) == family_keys) == (payload.client.tier == "phone")
    assert families.trained == {"tiny"} and stats.server_flops > 0  # the families were distilled into the target
    assert any(not torch.equal(target[k], initial[k]) for k in initial)
    with pytest.raises(ValueError, match="3 tiers"):
        run_mixed(run, tiers[:3], _families(cfg), initial)
    own = _families(cfg)
    own.tokenizer_json["tiny"] = "{}"  # a family with a tokenizer of its own: the client role re-tokenises for it
    with pytest.raises(ValueError, match="tokenizers of their own"):
        run_mixed(run, tiers, own, initial)
