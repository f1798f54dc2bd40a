"""A text source's shards read on demand (fedfusion/data/shards.py): exactly the slices of the text as it is read
whole, from the file where its characters are its bytes, from the text otherwise; and the population over them."""

from __future__ import annotations

import json

import pytest

from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import (
    ClientData,
    TextPopulation,
    client_names,
    data_spec,
    partition_sizes,
    pooled_held_out,
    population_data,
)
from fedfusion.data.shards import Shards, plain_size, text_shards
from fedfusion.data.text import load_text_file, split_text


def slices(text: str, count: int) -> list[str]:
    """What the shards must be: ``count`` equal slices of ``text``, the remainder dropped."""
    size = len(text) // count
    return [text[i * size:(i + 1) * size] for i in range(count)]


@pytest.mark.parametrize("count", [1, 3, 7, 40])
def test_an_ascii_file_is_read_shard_by_shard_as_the_whole_text_slices(tmp_path, count):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i}: to be, or not to be\n" for i in range(97)))
    shards = text_shards(path, count)
    assert shards.text is None and shards.path == str(path)  # nothing held
    assert list(shards) == slices(path.read_text(), count) and len(shards) == count
    assert shards[-1] == shards[count - 1] and shards[1:3] == list(shards)[1:3]
    with pytest.raises(IndexError):
        shards[count]


@pytest.mark.parametrize("body", ["é-accented text, naïve café\n" * 20, "windows\r\nline ends\r\n" * 20,
                                  "an old mac\rline end\r" * 20])
def test_a_file_whose_characters_are_not_its_bytes_is_held_and_sliced(tmp_path, body):
    path = tmp_path / "corpus.txt"
    path.write_bytes(body.encode("utf-8"))
    assert plain_size(path) is None
    shards = text_shards(path, 6)
    assert shards.text == path.read_text(encoding="utf-8")  # newlines translated as read_text does
    assert list(shards) == slices(path.read_text(encoding="utf-8"), 6)


def test_a_jsonl_file_is_its_records_joined(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i} says something"}) + "\n" for i in range(30)))
    assert plain_size(path) is None
    assert list(text_shards(path, 4)) == slices(load_text_file(path), 4)


def test_no_shards_is_an_error(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("some text")
    with pytest.raises(ValueError, match="count must be positive"):
        text_shards(path, 0)


def test_the_text_population_is_its_shards_split_into_train_and_held_out(tmp_path, monkeypatch):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"sentence number {i} of the corpus. " for i in range(300)))
    recipe = load_recipe("quickstart", ["data.source=text", f"data.path={path}", "population.num_clients=9",
                                        "selection.clients_per_round=2", "data.held_out=0.2"])
    clients = population_data(data_spec(recipe.data_source()))
    assert isinstance(clients, TextPopulation)
    assert list(clients) == [ClientData(f"shard-{i}", *split_text(s, 0.2))
                             for i, s in enumerate(slices(path.read_text(), 9))]
    expected = (tuple(c.name for c in clients), tuple(len(c.train) for c in clients))
    monkeypatch.setattr(Shards, "__getitem__", lambda *a: pytest.fail("a shard was read"))  # counted without it
    sizes = partition_sizes(recipe.data_source(), "submodel")
    assert (sizes.unit, sizes.names, sizes.examples) == ("characters", *expected)
    assert client_names(data_spec(recipe.data_source())) == expected[0]


def test_a_file_changed_after_it_was_sharded_is_an_error_not_another_shard(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdefghij" * 10)
    shards = text_shards(path, 5)
    assert shards[4] == ("abcdefghij" * 10)[80:]
    path.write_text("abcdefghij" * 5)
    with pytest.raises(ValueError, match="changed since"):
        shards[4]


def test_pooled_held_out_takes_one_character_from_evenly_spread_clients_of_a_larger_population(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(chr(ord("a") + i % 26) * 20 for i in range(200)))  # shard i: 20 of one letter
    spec = data_spec(load_recipe("quickstart", ["data.source=text", f"data.path={path}",
                                                "population.num_clients=200", "selection.clients_per_round=2"]).data_source())
    held = pooled_held_out(spec, 50).split("\n")
    assert held == [chr(ord("a") + (4 * i) % 26) for i in range(50)]  # clients 0, 4, 8, ...: one character each
    assert pooled_held_out(spec, 800).split("\n") == [chr(ord("a") + i % 26) * 2 for i in range(200)]  # all, 2 each
