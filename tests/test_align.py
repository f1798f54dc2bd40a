"""Tokenizer alignment: edit-distance DP on known strings, and teacher distributions mapped across vocabularies."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from fp_bounds import assert_within, gamma, unit_roundoff
from tokenizers import Tokenizer, normalizers

from fedfusion.data.text import build_char_tokenizer, encode_text
from fedfusion.fusion.distill.align import TokenBridge, char_alignment, token_starts
from fedfusion.train.transfer import train_bpe, wrap_tokenizer

TEXT = "the theme of the thee to the top then to them " * 20


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXT, 290)


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


def _levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_char_alignment_on_known_strings():
    assert char_alignment("same", "same").tolist() == [0, 1, 2, 3]
    assert char_alignment("kitten", "sitting").tolist() == [0, 1, 2, 3, 4, 5]  # k~s, e~i substituted
    assert char_alignment("abc", "abxc").tolist() == [0, 1, 3]  # x inserted
    assert char_alignment("abxc", "abc").tolist() == [0, 1, -1, 2]  # x deleted
    assert char_alignment("", "abc").tolist() == [] and char_alignment("ab", "").tolist() == [-1, -1]


def test_char_alignment_is_monotone_and_minimal():
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 9)))
        out = char_alignment(a, b)
        matched = out[out >= 0]
        assert np.all(np.diff(matched) > 0)  # order-preserving, one-to-one
        cost = sum(a[i] != b[j] for i, j in enumerate(out) if j >= 0) + (out < 0).sum() + len(b) - len(matched)
        assert cost == _levenshtein(a, b)


def test_token_starts():
    assert token_starts(["the", " then", ""]).tolist() == [0, 3, 8]


def _teacher_logits(bridge, bridged, probs_at: dict[int, dict[str, float]]) -> torch.Tensor:
    """Logits over the teacher vocabulary: at teacher position j the given token probabilities, else uniform."""
    logits = torch.zeros(1, bridged.teacher_ids.shape[1], len(bridge.teacher))
    for pos, probs in probs_at.items():
        logits[0, pos] = float("-inf")
        for token, p in probs.items():
            (tid,) = bridge.teacher.encode(token, add_special_tokens=False)
            logits[0, pos, tid] = float(np.log(p))
    return logits


def test_bpe_teacher_maps_onto_next_character_by_prefix(bpe, char):
    window = encode_text(char, "the then")[None]  # teacher tokens: "the", " then"
    bridge = TokenBridge(bpe, char)
    assert not bridge.same and bridge.char_student
    bridged = bridge.prepare(window)
    assert [bpe.decode([i]) for i in bridged.teacher_ids[0].tolist()] == ["the", " then"]
    # positions 0, 1 predict the "h", "e" inside the first teacher token: no teacher context
    assert bridged.source[0].tolist() == [-1, -1, 0, 0, 0, 0, 0]
    logits = _teacher_logits(bridge, bridged, {0: {" the": 0.5, " to": 0.3, "the": 0.2}})
    log_probs, mask = bridge.map(logits, bridged, torch.tensor([0]))
    probs = log_probs.exp()[0]
    cid = char.convert_tokens_to_ids

    def dist(i):
        return {c: round(float(probs[i, cid(c)]), 4) for c in " tho" if probs[i, cid(c)] > 1e-6}

    assert dist(2) == {" ": 0.8, "t": 0.2}  # next token starts " the" / " to" (0.8) or "the" (0.2)
    assert dist(3) == {"t": 1.0}  # after " ": both spaced tokens go on with "t"
    assert dist(4) == {"h": 0.625, "o": 0.375}  # after " t": " the" 0.5 vs " to" 0.3, renormalised
    # after " the" only tokens longer than the prefix count; the teacher gave them no mass: masked
    assert mask[0].tolist() == [False, False, True, True, True, True, False]
    # each row sums to 1 within its rounding: a row x / fl(sum x) (the positive sum and the division: gamma_V; a
    # masked row's 1 / V, gamma_1), each floored entry 1e-10 more (the map's floor, not rounding), then log and the
    # test's exp round each entry by 2u |log p| + gamma_4 relative (their ulps, exp's 2) and the V-term sum gamma_V
    lp = log_probs[0].double()
    v, u = lp.shape[-1], unit_roundoff(torch.float32)
    floored = (lp <= math.log(1e-10) + 1e-6).sum(-1) * 1e-10
    bound = 2 * gamma(v, torch.float32) + floored + (lp.exp() * (2 * u * lp.abs() + gamma(4, torch.float32))).sum(-1)
    assert_within(probs.sum(-1), torch.ones(7), bound)


def test_char_teacher_to_bpe_student_keeps_only_positions_it_can_express(bpe, char):
    window = encode_text(bpe, "the, then")[None]
    assert [bpe.decode([i]) for i in window[0].tolist()] == ["the", ",", " then"]
    bridge = TokenBridge(char, bpe)
    assert not bridge.char_student
    bridged = bridge.prepare(window)
    # student position 0 predicts "," (one char: the char teacher's next token covers it);
    # position 1 predicts " then" (5 chars, more than one teacher step): masked
    assert bridged.source[0].tolist() == [2, -1]
    logits = _teacher_logits(bridge, bridged, {2: {",": 0.7, " ": 0.3}})
    log_probs, mask = bridge.map(logits, bridged, torch.tensor([0]))
    (comma,), (space,) = bpe.encode(",", add_special_tokens=False), bpe.encode(" ", add_special_tokens=False)
    assert mask[0].tolist() == [True, False]
    # float32: the logits log p rounded (moving each probability by at most 2 u max|log p| relatively), then softmax,
    # the candidates' mass, the division, the log and the test's exp: gamma_8 more, relative
    u, spread = unit_roundoff(torch.float32), max(abs(math.log(0.7)), abs(math.log(0.3)))
    for token, p in ((comma, 0.7), (space, 0.3)):
        assert abs(log_probs[0, 0, token].exp().item() - p) <= p * (2 * u * spread + gamma(8, torch.float32))


def test_surfaces_that_differ_are_aligned_by_dynamic_programming(bpe, char):
    backend = Tokenizer.from_str(bpe.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Lowercase()
    lower = wrap_tokenizer(backend.to_str())
    window = encode_text(char, "The Then")[None]
    bridge = TokenBridge(lower, char)
    bridged = bridge.prepare(window)
    # the teacher sees "the then": the DP aligns "T" with "t", so every position past the first token is sourced
    assert bridged.source[0].tolist() == [-1, -1, 0, 0, 0, 0, 0]
    logits = _teacher_logits(bridge, bridged, {0: {" then": 1.0}})
    log_probs, _ = bridge.map(logits, bridged, torch.tensor([0]))
    # the limit made visible: a lowercasing teacher predicts "t" where the text has "T"
    assert log_probs[0, 3, char.convert_tokens_to_ids("t")].exp().item() == 1.0  # exp(0), zeros, 1 / 1: exact


def test_same_vocabulary_skips_alignment(char):
    bridge = TokenBridge(char, build_char_tokenizer())
    assert bridge.same
    with pytest.raises(ValueError, match="share a vocabulary"):
        bridge.prepare(encode_text(char, "abc")[None])


def test_teacher_window_longer_than_its_model_is_refused(bpe, char):
    with pytest.raises(ValueError, match="over its limit 2"):
        TokenBridge(char, bpe).prepare(encode_text(bpe, "the theme of the")[None], max_teacher_len=2)
