"""benchmarks/privacy.py's measures on toy cases that can fail: exposure from a sampled rank, a model trained to
memorise a canary against canaries it never saw, the generative reply's trigram scorer, verbatim search."""

from __future__ import annotations

import math
import random
import statistics
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


def test_an_inserted_canary_is_set_against_the_single_never_inserted_ones() -> None:
    """The one-canary test: per insertion count, the seeds whose canary scores above the 95th percentile of every
    never-inserted canary of that view (pooled over seeds), and that percentile with the references' count."""
    refs = [[float(i + 8 * s) / 10 for i in range(8)] for s in range(3)]  # 24 references: 0.0 .. 2.3 bits
    pooled = sorted(x for seed in refs for x in seed)
    p95 = statistics.quantiles(pooled, n=20)[-1]

    def run(seed: int, canary: dict[int, float]) -> dict:
        final = {str(n): {"sampled": v} for n, v in canary.items()}
        final["0"] = {"sampled": sum(refs[seed]) / 8, "each": refs[seed]}
        view = {str(n): {"exposure": {str(n): {"sampled": v}, "0": {"sampled": 0.0, "each": refs[seed]}}}
                for n, v in canary.items()}
        return {"final": final, "views": view}

    runs = [run(0, {1: 0.5, 4: 3.0, 16: 9.0}), run(1, {1: 0.1, 4: 0.2, 16: 8.0}), run(2, {1: 0.2, 4: 0.3, 16: p95})]
    cells = privacy.above_references(runs, "final")
    assert cells == ["0 of 3", "1 of 3", "2 of 3", f"{p95:.2f} (24)"]  # seed 2's 16x canary, at the percentile: not above
    views = statistics.quantiles(pooled * 3, n=20)[-1]  # a server's view: each canary client's view's references
    assert views < p95  # the repeated references put the percentile lower: seed 2's 16x canary is above this one
    assert privacy.above_references(runs, "views") == ["0 of 3", "1 of 3", "3 of 3", f"{views:.2f} (72)"]
    assert privacy.above_references(runs[:2], "final") == ["-"] * 4  # 16 references: too few for a percentile
