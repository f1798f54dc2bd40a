"""Tests for fedfusion.data.text: Shakespeare roles, text splits, the char tokenizer and LM windows."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from fedfusion.data.text import (
    Role,
    _spoken_lines,
    build_char_tokenizer,
    encode_text,
    lm_windows,
    load_shakespeare_roles,
    load_text_file,
    sample_batch,
    split_text,
)

ROUNDTRIP = "To be, or not to be: that is the question.\n  Whether 'tis nobler -- [in] the {mind} ~ ?!\n\n"
TOKENIZER_CHARS = set("\n" + "".join(chr(code) for code in range(32, 127)))


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_roles_are_many_long_sorted_and_unique():
    roles = load_shakespeare_roles()
    assert len(roles) > 400
    assert all(len(role.text) >= 2000 for role in roles)
    keys = [(role.play, role.speaker) for role in roles]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert len({role.play for role in roles}) > 30


def test_min_chars_filters_a_cached_parse():
    everyone = load_shakespeare_roles(min_chars=0)
    long = load_shakespeare_roles(min_chars=20_000)
    assert set(long) < set(load_shakespeare_roles()) < set(everyone)
    assert all(len(role.text) >= 20_000 for role in long)
    everyone.clear()  # the returned list is the caller's; the cache is not affected
    assert len(load_shakespeare_roles(min_chars=0)) > 1000


def test_known_role_holds_only_spoken_ascii_lines():
    hamlet = {(r.play, r.speaker): r for r in load_shakespeare_roles()}[("hamlet", "HAMLET")]
    assert hamlet.text.startswith("A little more than kin, and less than kind.\n")
    assert "To be, or not to be: that is the question:" in hamlet.text
    for role in load_shakespeare_roles(min_chars=0):
        assert set(role.text) <= TOKENIZER_CHARS, role
        assert not any(mark in role.text for mark in ("**", "_", "#", "\\", "[", "]", "\n\n")), role


def test_spoken_lines_drop_markup():
    markdown = "\n".join(
        [
            "# Play",
            "### SCENE I. A heath.",
            "Untagged prologue line.",
            "_Enter A and",
            "B_",
            "**A**  ",
            "First \\--line.  ",
            "_\\[Aside]_  ",
            "__\\[Reads]_ Second line.",
            "*Exit B.*",
            "Still A\u2014here.",
            "**B**",
            "[Within]_  ",
            "Who's there?",
        ]
    )
    assert list(_spoken_lines(markdown)) == [
        ("A", "First --line."),
        ("A", "Second line."),
        ("A", "Still A--here."),
        ("B", "Who's there?"),
    ]


def test_role_is_frozen():
    role = Role("hamlet", "HAMLET", "text")
    with pytest.raises(AttributeError):
        role.text = "other"


@pytest.mark.parametrize("held_out", [0.1, 0.25, 0.5])
def test_split_text_is_a_contiguous_proportional_split(held_out):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    train, rest = split_text(text, held_out)
    assert train + rest == text
    assert len(rest) == round(1000 * held_out)


@pytest.mark.parametrize("held_out", [0.0, 1.0, -0.1, 1.5])
def test_split_text_rejects_held_out_outside_unit_interval(held_out):
    with pytest.raises(ValueError, match="held_out"):
        split_text("some text", held_out)


def test_tokenizer_has_fixed_vocabulary(tok):
    assert len(tok) == 100
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["\n", " ", "!", "~"]) == [4, 5, 6, 99]


def test_tokenizer_roundtrips_without_added_specials(tok):
    ids = tok.encode(ROUNDTRIP)
    assert len(ids) == len(ROUNDTRIP)
    assert min(ids) >= 4
    assert tok.decode(ids) == ROUNDTRIP


def test_tokenizer_maps_other_characters_to_unk(tok):
    assert tok.encode("a\u00e9\tb") == [tok.convert_tokens_to_ids("a"), 1, 1, tok.convert_tokens_to_ids("b")]


def test_tokenizer_survives_save_and_auto_load(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok)
    assert loaded.encode(ROUNDTRIP) == tok.encode(ROUNDTRIP)
    assert loaded.decode(tok.encode(ROUNDTRIP)) == ROUNDTRIP
    assert loaded.pad_token_id == 0


def test_encode_text_gives_1d_long_ids(tok):
    ids = encode_text(tok, ROUNDTRIP)
    assert ids.dtype == torch.long
    assert ids.shape == (len(ROUNDTRIP),)
    assert ids.tolist() == tok.encode(ROUNDTRIP)


def test_lm_windows_are_non_overlapping_and_drop_the_tail():
    windows = lm_windows(torch.arange(23), seq_len=4)
    assert windows.shape == (4, 5)
    assert windows.flatten().tolist() == list(range(20))
    assert torch.equal(windows[:, 1:], windows[:, :-1] + 1)  # labels are inputs shifted by one


def test_lm_windows_exact_fit():
    assert lm_windows(torch.arange(5), seq_len=4).tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("length, seq_len", [(4, 4), (0, 1), (10, 0)])
def test_lm_windows_reject_too_short_ids(length, seq_len):
    with pytest.raises(ValueError, match=rf"seq_len={seq_len}.*length {length}"):
        lm_windows(torch.arange(length), seq_len)


def test_sample_batch_draws_rows_reproducibly():
    windows = lm_windows(torch.arange(30), seq_len=2)
    batch = sample_batch(windows, 64, torch.Generator().manual_seed(0))
    assert batch.shape == (64, 3)
    rows = {tuple(row) for row in windows.tolist()}
    assert {tuple(row) for row in batch.tolist()} <= rows
    assert len({tuple(row) for row in batch.tolist()}) < 64  # with replacement: 64 draws from 10 rows
    assert torch.equal(batch, sample_batch(windows, 64, torch.Generator().manual_seed(0)))


def test_load_text_file_reads_txt_as_is(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("line one\nline two\n", encoding="utf-8")
    assert load_text_file(path) == "line one\nline two\n"


def test_load_text_file_joins_a_jsonl_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(["a b", "c"])) + "\n\n")
    assert load_text_file(str(path), field="body") == "a b\nc"


def test_load_text_file_rejects_missing_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(ValueError, match="line 2 has no field 'text'"):
        load_text_file(path)


def test_load_text_file_rejects_other_suffixes(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text("text\nx\n")
    with pytest.raises(ValueError, match="corpus.csv"):
        load_text_file(path)
