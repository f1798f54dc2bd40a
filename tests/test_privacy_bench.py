"""benchmarks/privacy.py's measures on toy cases that can fail: exposure from a sampled rank, a model trained to
memorise a canary against canaries it never saw, the generative reply's trigram scorer, verbatim search."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import privacy  # noqa: E402

from fedfusion.data.facts import build_word_tokenizer  # noqa: E402


def test_exposure_from_a_sampled_rank() -> None:
    candidates = torch.arange(1000, dtype=torch.float64)  # scores 0 .. 999, lower = likelier
    best = privacy.exposure(-1.0, candidates)
    assert math.isclose(best["sampled"], math.log2(1001)) and best["rank_share"] == 0.0
    middle = privacy.exposure(499.5, candidates)  # 500 candidates better: rank share one half
    assert math.isclose(middle["sampled"], -math.log2(501 / 1001))
    assert privacy.exposure(2000.0, candidates)["sampled"] < 0.01  # worse than every candidate: no exposure
    normal = torch.randn(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    far = privacy.exposure(-5.0, normal)  # 5 sd below normal scores: tail 2.9e-7, 21.7 bits, beyond the sample
    assert far["sampled"] == math.log2(4001) and 20 < far["fit"] < 23.5
    assert privacy.exposure(-5.0, normal, space_bits=5.0)["fit"] <= 5.0  # capped at log2|R|


def _toy() -> tuple[object, LlamaForCausalLM]:
    tok = build_word_tokenizer([privacy.CANARY_VOCAB])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=32)
    torch.manual_seed(0)
    return tok, LlamaForCausalLM(cfg)


@pytest.mark.slow  # 150 training steps until a model memorises a canary: ~1.3 s
def test_memorised_canary_against_never_seen_ones() -> None:
    tok, model = _toy()
    rng = random.Random(0)
    canary, *unseen = privacy.draw_secrets(rng, 9)
    others = privacy.draw_secrets(rng, 64)  # other text of the same form, so the model learns digits in general
    data = torch.cat([privacy.encode_secrets(tok, [canary] * 32), privacy.encode_secrets(tok, others)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(input_ids=data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    candidates = privacy.sequence_nll(model, privacy.encode_secrets(tok, privacy.draw_secrets(random.Random(1), 511)))
    score = privacy.sequence_nll(model, privacy.encode_secrets(tok, [canary]))[0]
    seen = privacy.exposure(float(score), candidates)
    assert seen["sampled"] == math.log2(512)  # ranks above every sampled candidate
    assert seen["fit"] > 15  # and far out in the candidates' tail: near log2|R| (29.9)
    floor = [privacy.exposure(float(s), candidates)["sampled"]
             for s in privacy.sequence_nll(model, privacy.encode_secrets(tok, unseen))]
    assert sum(floor) / len(floor) < 3.0  # never seen: -log2 of a uniform draw, 1.44 bits on average


def test_samples_scorer_and_verbatim_search() -> None:
    tok = build_word_tokenizer([privacy.CANARY_VOCAB])
    rng = random.Random(2)
    canary, *unseen = privacy.draw_secrets(rng, 9)
    ids = privacy.encode_secrets(tok, [canary])
    noise = privacy.encode_secrets(tok, privacy.draw_secrets(rng, 40))
    leaky = torch.cat([noise, ids.repeat(4, 1)])  # samples that repeat the canary
    candidates = privacy.encode_secrets(tok, privacy.draw_secrets(random.Random(3), 255))
    secret = ids[0, -privacy.DIGITS - 1:-1].tolist()
    for samples, leaked in ((leaky, True), (noise, False)):
        scorer = privacy.SampleScorer(samples, len(tok))
        bits = privacy.exposure(float(scorer.nll(ids)[0]), scorer.nll(candidates))["sampled"]
        assert (bits == math.log2(256)) if leaked else bits < 4
        assert privacy.contains(samples, secret) is leaked
    floor = [privacy.exposure(float(s), privacy.SampleScorer(leaky, len(tok)).nll(candidates))["sampled"]
             for s in privacy.SampleScorer(leaky, len(tok)).nll(privacy.encode_secrets(tok, unseen))]
    assert sum(floor) / len(floor) < 3.0
    # top-k probabilities count instead of the sampled token: a reply whose top-1 is the canary's next token leaks it
    top_ids = torch.cat([leaky[:, 1:], leaky[:, -1:]], dim=1)[..., None]  # each position's next token, k = 1
    soft = privacy.SampleScorer(leaky, len(tok), top_ids, torch.zeros(top_ids.shape))
    assert privacy.exposure(float(soft.nll(ids)[0]), soft.nll(candidates))["sampled"] == math.log2(256)


def test_capturing_shows_each_reply_and_each_rounds_folded_target() -> None:
    """The secure-aggregation view is the round's folded target: the last one ``on_round`` sees is the run's final
    target bit for bit, every reply of every round passes ``on_reply`` first, and the driver is restored after."""
    from fedfusion.fusion.inprocess import SubModelRun, run_submodel
    from tests.conftest import tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(3, cfg.vocab_size, (12, 9), generator=gen) for _ in range(3)]
    run = SubModelRun(cfg, windows, [0.5, 1.0, 0.5], policy="rolling", rounds=2, per_round=2, steps=2, lr=0.01,
                      batch_size=4)
    replies: list[int] = []
    targets: dict[int, dict] = {}
    original = privacy.inprocess.run_rounds
    with privacy.capturing(lambda methods, rnd, payload, reply: replies.append(rnd),
                           lambda rnd, target: targets.setdefault(rnd, dict(target))):
        final, _ = run_submodel(run, state)
    assert privacy.inprocess.run_rounds is original
    assert replies == [1, 1, 2, 2] and sorted(targets) == [1, 2]
    assert all(torch.equal(targets[2][k], v) for k, v in final.items())
    assert any(not torch.equal(targets[1][k], v) for k, v in final.items())


def test_fisher_p_is_the_exact_null_of_sampled_exposures() -> None:
    """One canary: its p-value is 2^-exposure (the share of candidates scoring at least as well); several: Fisher's
    combination, checked against a simulation of canaries never trained on (uniform ranks among the candidates)."""
    assert privacy.fisher_p([math.log2(20)]) == pytest.approx(0.05)
    assert privacy.fisher_p([0.0, 0.0, 0.0]) == pytest.approx(1.0)
    rng = random.Random(0)
    n, trials, observed = 4095, 20000, [4.5, 3.43, 3.29]
    threshold = -sum(math.log(2.0 ** -e) for e in observed)
    hits = 0
    for _ in range(trials):  # three seeds' never-inserted canaries: ranks uniform among n + 1
        stat = -sum(math.log((rng.randrange(n + 1) + 1) / (n + 1)) for _ in observed)
        hits += stat >= threshold
    p = privacy.fisher_p(observed)
    assert abs(hits / trials - p) < 4 * math.sqrt(p * (1 - p) / trials)  # within 4 binomial standard errors


def test_leak_cells_combine_each_insertions_seeds_and_report_the_references_mean() -> None:
    refs = [[0.5, 1.0, 1.5, 2.0] for _ in range(3)]

    def run(canary: dict[int, float]) -> dict:
        final = {str(n): {"sampled": v} for n, v in canary.items()}
        final["0"] = {"sampled": 1.25, "each": refs[0]}
        views = {str(n): {"exposure": {str(n): {"sampled": v + 1}, "0": {"sampled": 1.25, "each": refs[0]}}}
                 for n, v in canary.items() if n != 4}  # the 4x canary's client never replied in this view
        return {"final": final, "views": views}

    runs = [run({1: 0.5, 4: 12.0, 16: 3.0}), run({1: 1.0, 4: 12.0, 16: 4.0}), run({1: 0.2, 4: 12.0, 16: 5.0})]
    final = privacy.leak_cells(runs, "final")
    assert final == [f"{privacy.fisher_p([0.5, 1.0, 0.2]):.2g}", f"{privacy.fisher_p([12.0] * 3):.2g}",
                     f"{privacy.fisher_p([3.0, 4.0, 5.0]):.2g}", "1.25 (12)"]
    assert privacy.fisher_p([12.0] * 3) < 1e-8 < privacy.fisher_p([3.0, 4.0, 5.0]) < 0.05 < privacy.fisher_p([0.5, 1.0, 0.2])
    views = privacy.leak_cells(runs, "views")
    assert views == [f"{privacy.fisher_p([1.5, 2.0, 1.2]):.2g}", "-", f"{privacy.fisher_p([4.0, 5.0, 6.0]):.2g}",
                     "1.25 (24)"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "mixed"])
def test_a_lora_and_a_mixed_run_score_every_canary_clients_last_reply_and_the_final_target(method: str) -> None:
    """One tiny run of each method the in-process LoRA and mixed loops added: every canary client's view is read at
    the last round the run samples it, each exposure lies within the sampled rank's range, each extraction rate is a
    share, and only LoRA (whose fold is a sum) has a secure-aggregation view."""
    args = {"people": 24, "clients": 6, "rounds": 2, "candidates": 63, "epsilon": 0.0}
    out = privacy.run_method({"method": method, "seed": 0, "args": args})
    last = {p: rnd for rnd, sampled in enumerate(privacy.schedule(2, 6, 6, 0), start=1) for p in sampled}
    cap = math.log2(args["candidates"] + 1)
    assert sorted(out["views"]) == sorted(out["holders"]) == ["1", "16", "4"]
    for n, view in out["views"].items():
        assert view["round"] == last[out["holders"][n]]
        assert 0.0 <= view["extraction"] <= 1.0
        assert all(0.0 <= e["sampled"] <= cap for e in view["exposure"].values())
    assert all(0.0 <= e["sampled"] <= cap for e in out["final"].values())
    assert (sorted(out["secure"]) == ["1", "16", "4"]) == (method == "lora")
