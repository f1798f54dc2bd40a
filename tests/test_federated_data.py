"""data.source=dataset: local jsonl/csv/parquet/txt files split by each flwr-datasets partitioner, for the LM and
instruction tasks; partition sizes in plan and report; recipe errors that name the bad key."""

from __future__ import annotations

import json
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

import pytest

from fedfusion.analysis.report import write_report
from fedfusion.cli import main
from fedfusion.config.sections import RecipeError
from fedfusion.data.federated import PartitionSizes, describe, label_skew, partitions, read_partition_sizes
from fedfusion.data.instruct import instruct_clients, pooled_held_out
from fedfusion.data.population import (
    data_spec,
    lora_data_spec,
    partition_sizes,
    population_data,
    write_partition_sizes,
)
from fedfusion.run.check import load_checked
from tests.ray_actors import ONE_ACTOR

# flwr-datasets (and the pandas, datasets and matplotlib it imports: seconds) is imported by the tests that partition,
# not at collection: with -n every worker collects every module. The group runs them on one worker, which alone pays it.
pytestmark = [pytest.mark.skipif(find_spec("flwr_datasets") is None, reason="needs flwr-datasets: pip install 'fedfusion[datasets]'"),
              pytest.mark.xdist_group("flwr_datasets")]

LABELS = ("sport", "music", "food", "travel")
USERS = ("ann", "bob", "cy", "dee")


def records(n: int = 120) -> list[dict]:
    """Rows with text, a label, a user id and an instruction pair; the label and user sequences are unrelated."""
    return [{"text": f"row {i}: " + LABELS[i % 4] * (1 + i % 5), "label": LABELS[i % 4], "user": USERS[(i // 3) % 4],
             "prompt": f"what is {i}?", "response": f"it is {i}."} for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The same rows as jsonl, csv and parquet, and their texts as a .txt file (one row per line)."""
    import pandas as pd  # installed with flwr-datasets' datasets

    folder, rows = tmp_path_factory.mktemp("data"), records()
    paths = {fmt: folder / f"rows.{fmt}" for fmt in ("jsonl", "csv", "parquet", "txt")}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_csv(paths["csv"], index=False)
    pd.DataFrame(rows).to_parquet(paths["parquet"])
    paths["txt"].write_text("\n".join(r["text"] for r in rows) + "\n")
    return paths


def recipe_for(path: Path | str, partitioner: str, clients: int = 4, *more: str):
    return load_checked("rolling", ["data.source=dataset", f"data.dataset={path}", f"data.partitioner={partitioner}",
                                   f"population.num_clients={clients}", "selection.clients_per_round=2", *more])


def rows_of(recipe) -> list[list[str]]:
    return [list(p["text"]) for p in partitions(data_spec(recipe.data_source()))]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_iid_splits_every_file_type_into_equal_disjoint_parts_covering_it(files, fmt):
    parts = rows_of(recipe_for(files[fmt], "{name: iid}"))
    assert [len(p) for p in parts] == [30] * 4
    assert sorted(t for p in parts for t in p) == sorted(r["text"] for r in records())


def test_iid_without_shuffle_keeps_file_order_as_contiguous_shards(files):
    parts = rows_of(recipe_for(files["txt"], "{name: iid}", 4, "data.shuffle=false"))
    assert parts[0] == [r["text"] for r in records()[:30]]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_natural_gives_each_id_its_own_client_named_after_it(files, fmt):
    recipe = recipe_for(files[fmt], "{name: natural, by: user}")
    parts = partitions(data_spec(recipe.data_source()))
    assert [set(p["user"]) for p in parts] == [{u} for u in sorted(USERS)]
    assert [len(p) for p in parts] == [Counter(r["user"] for r in records())[u] for u in sorted(USERS)]
    assert [c.name for c in population_data(data_spec(recipe.data_source()))] == [f"user={u}" for u in sorted(USERS)]


def test_natural_with_a_population_of_another_size_names_the_fix(files):
    with pytest.raises(ValueError, match="population.num_clients: .* 4 distinct 'user' values.*set population.num_clients=4"):
        partitions(data_spec(recipe_for(files["parquet"], "{name: natural, by: user}", 3).data_source()))


def test_dirichlet_skews_labels_more_as_alpha_falls_and_is_seeded(files):
    def top_share(alpha: float, seed: int = 0) -> float:
        recipe = recipe_for(files["jsonl"], f"{{name: dirichlet, by: label, alpha: {alpha}, min_partition_size: 2}}",
                            4, f"seed={seed}")
        return label_skew(partition_sizes(recipe.data_source(), recipe.fusion.method))["mean_top_share"]

    assert top_share(0.05) > top_share(1000.0) + 0.2
    spec = data_spec(recipe_for(files["jsonl"], "{name: dirichlet, by: label, alpha: 0.3, min_partition_size: 2}").data_source())
    first = [list(p["text"]) for p in partitions(spec)]
    partitions.cache_clear()
    assert [list(p["text"]) for p in partitions(spec)] == first  # every process rebuilds the same partition


def test_shard_gives_each_client_its_shards_of_the_sorted_labels(files):
    parts = partitions(data_spec(recipe_for(files["parquet"], "{name: shard, by: label, num_shards_per_partition: 1}").data_source()))
    assert [len(set(p["label"])) for p in parts] == [1] * 4  # one shard of a label-sorted table: one label
    assert sorted(t for p in parts for t in p["text"]) == sorted(r["text"] for r in records())


def test_pathological_limits_each_client_to_its_number_of_labels(files):
    recipe = recipe_for(files["csv"], "{name: pathological, by: label, num_classes_per_partition: 2, "
                                      "class_assignment_mode: deterministic}")
    assert all(len(set(p["label"])) <= 2 for p in partitions(data_spec(recipe.data_source())))


def test_lm_clients_train_on_their_rows_text_and_hold_out_its_tail(files):
    recipe = recipe_for(files["jsonl"], "{name: natural, by: user}")
    clients, parts = population_data(data_spec(recipe.data_source())), partitions(data_spec(recipe.data_source()))
    for client, part in zip(clients, parts):
        assert client.train + client.held_out == "\n".join(part["text"])
        assert 0 < len(client.held_out) < len(client.train)


@pytest.mark.usefixtures("lora_base_installed")
def test_instruction_pairs_come_from_the_prompt_and_response_columns(files):
    recipe = recipe_for(files["parquet"], "{name: dirichlet, by: label, alpha: 0.5, min_partition_size: 2}", 4,
                        "fusion.method=lora", "train.seq_len=64", "data.held_out=0.2")
    spec = lora_data_spec(recipe.data_source())
    clients, parts = instruct_clients(spec), partitions(data_spec(recipe.data_source()))
    for client, part in zip(clients, parts):
        assert len(client.train) + len(client.held_out) == len(part)
        assert len(client.held_out) == max(1, round(0.2 * len(part)))
        assert {p.prompt for p in client.train + client.held_out} == set(part["prompt"])
        assert all(p.response == p.prompt.replace("what is", "it is").replace("?", ".") for p in client.train)
        assert {p.category for p in client.train} <= set(part["label"])  # the label column, for the skew
    assert sorted(p.prompt for p in pooled_held_out(spec)) == sorted(p.prompt for c in clients for p in c.held_out)


@pytest.mark.usefixtures("lora_base_installed")
def test_the_built_in_corpora_are_datasets_like_any_other():
    recipe = load_checked("rolling", ["data.source=dataset", "data.dataset=shakespeare", "data.min_chars=20000",
                                     "data.partitioner={name: natural, by: role}", "population.num_clients=4",
                                     "selection.clients_per_round=2", "data.shuffle=false"])
    with pytest.raises(ValueError, match="population.num_clients: shakespeare has (\\d+) distinct 'role'"):
        partitions(data_spec(recipe.data_source()))
    recipe = load_checked("rolling", ["data.source=dataset", "data.dataset=chatterbot", "fusion.method=lora",
                                     "data.partitioner={name: dirichlet, by: category, alpha: 0.1}",
                                     "population.num_clients=4", "selection.clients_per_round=2"])
    sizes = partition_sizes(recipe.data_source(), recipe.fusion.method)
    assert sizes.unit == "pairs" and sizes.label == "category" and len(sizes.labels) == 4
    assert label_skew(sizes)["labels"] > 10


def test_a_missing_column_is_named_with_the_columns_there_are(files):
    with pytest.raises(ValueError, match="data.partitioner.by: .* has no column 'topic'; its columns: text, label"):
        partitions(data_spec(recipe_for(files["jsonl"], "{name: dirichlet, by: topic, alpha: 1.0}").data_source()))


def test_fewer_rows_than_clients_is_an_error_not_an_empty_client(tmp_path):
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match="population.num_clients: .*few.jsonl has 3 rows, fewer than the 4 clients"):
        partitions(data_spec(recipe_for(tmp_path / "few.jsonl", "{name: iid}").data_source()))


@pytest.mark.parametrize("partitioner,message", [
    ("{name: zipf}", "data.partitioner.name: 'zipf' is not one of iid, dirichlet, shard, pathological, natural"),
    ("{name: dirichlet, by: label}", "data.partitioner.alpha: the dirichlet partitioner needs it"),
    ("{name: dirichlet, by: label, alpha: -1}", "data.partitioner.alpha: must be > 0"),
    ("{name: dirichlet, by: label, alpha: 1, num_partitions: 3}", "data.partitioner.num_partitions: not a parameter"),
    ("{name: shard, by: label, shard_size: ten}", "data.partitioner.shard_size: expected int, got 'ten'"),
    ("{name: iid, by: label}", "data.partitioner.by: not a parameter of the iid partitioner"),
])
def test_a_bad_partitioner_is_a_recipe_error_naming_the_key(files, partitioner, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe_for(files["jsonl"], partitioner)


def test_a_dataset_recipe_without_a_dataset_or_with_a_missing_file_is_a_recipe_error(tmp_path):
    with pytest.raises(RecipeError, match="data.dataset: required when data.source is 'dataset'"):
        load_checked("quickstart", ["data.source=dataset"])
    with pytest.raises(RecipeError, match=f"data.dataset: {tmp_path}/no.parquet: no such file"):
        recipe_for(tmp_path / "no.parquet", "{name: iid}")


def test_sizes_go_to_the_run_directory_and_the_report_shows_them(files, tmp_path):
    recipe = recipe_for(files["jsonl"], "{name: dirichlet, by: label, alpha: 0.3, min_partition_size: 2}")
    write_partition_sizes(tmp_path, recipe.data_source(), recipe.fusion.method)
    sizes = read_partition_sizes(tmp_path)
    assert sizes == partition_sizes(recipe.data_source(), recipe.fusion.method) and sum(sizes.examples) == len(records())
    assert [sum(c.values()) for c in sizes.labels] == list(sizes.examples)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 0, "eval_loss": 4.0, "eval_ppl": 54.6,
                                                        "eval_acc": 0.0}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    report = write_report(tmp_path).read_text()
    assert "## Data" in report and "120 rows in all" in report and "labels (label): 4 in all" in report
    assert (tmp_path / "plots" / "partitions.png").stat().st_size > 0


def test_describe_draws_a_histogram_whose_bars_count_every_client():
    lines = describe(PartitionSizes("rows", tuple("abcde"), (1, 1, 2, 9, 10)))
    assert lines[0] == "data: 5 clients, 23 rows in all; per client min 1, median 2, max 10"
    assert sum(int(line.split()[-1]) for line in lines[1:]) == 5


def test_plan_prints_the_partition_sizes(files, capsys):
    assert main(["plan", "quickstart", "data.source=dataset", f"data.dataset={files['csv']}",
                 "data.partitioner={name: natural, by: user}", "population.num_clients=4",
                 "selection.clients_per_round=2"]) == 0
    out = capsys.readouterr().out
    assert "data: 4 clients, 120 rows in all" in out


def test_plan_of_the_quickstart_prints_characters_per_role(capsys):
    assert main(["plan", "quickstart"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data:"))
    assert line.startswith("data: 32 clients,") and "characters in all" in line


@pytest.mark.slow  # Flower's simulation engine (Ray)
def test_a_recipe_trains_end_to_end_from_a_local_parquet_file_with_tensorboard(tmp_path):
    import pandas as pd

    from fedfusion.analysis.report import read_jsonl

    words = ("the river runs", "a quiet field", "under the hill", "bright morning")
    rows = [{"text": " ".join(words[(i + k) % 4] for k in range(20)), "user": USERS[i % 4]} for i in range(40)]
    pd.DataFrame(rows).to_parquet(tmp_path / "posts.parquet")
    out = tmp_path / "run"
    assert main(["run", "rolling", "rounds=2", "population.num_clients=4", "selection.clients_per_round=2",
                 "data.source=dataset", f"data.dataset={tmp_path / 'posts.parquet'}",
                 "data.partitioner={name: natural, by: user}", "output.tracker=tensorboard",
                 "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=64",
                 "model.num_layers=1", "train.local_steps=2", "train.batch_size=4", "train.seq_len=32",
                 ONE_ACTOR, "--out", str(out)]) == 0  # submodel: stateless nodes (tests/ray_actors.py)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in metrics] == [0, 1, 2] and all(r["clients_ok"] == 2 for r in metrics[1:])
    assert read_partition_sizes(out).names == tuple(f"user={u}" for u in sorted(USERS))
    assert "## Data" in (out / "report.md").read_text()
    assert any((out / "tensorboard").iterdir())


def test_a_hub_id_goes_to_load_dataset_with_its_subset_and_split(monkeypatch):
    """Online users' path, without the network: the hub id, configuration and split reach ``datasets.load_dataset``."""
    import datasets

    calls = []

    def fake_load(name, subset=None, split=None, **kwargs):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(records(40))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    recipe = recipe_for("someone/reviews", "{name: dirichlet, by: label, alpha: 1.0, min_partition_size: 2}", 4,
                        "data.subset=plain", "data.dataset_split=validation")
    assert sum(len(p) for p in partitions(data_spec(recipe.data_source()))) == 40
    assert calls == [("someone/reviews", "plain", "validation")]


def test_a_changed_local_file_is_a_new_data_spec_and_a_new_partition(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    recipe = recipe_for(path, "{name: iid}")
    before, pairs_before = data_spec(recipe.data_source()), lora_data_spec(recipe.data_source())
    assert sum(len(p) for p in partitions(before)) == 40
    path.write_text("".join(json.dumps(r) + "\n" for r in records(48)))
    after = data_spec(recipe.data_source())
    assert after != before and lora_data_spec(recipe.data_source()) != pairs_before  # what was cached under the old spec is not reused
    assert sum(len(p) for p in partitions(after)) == 48


def test_a_changed_text_file_is_a_new_data_spec(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 50)
    recipe = load_checked("quickstart", ["data.source=text", f"data.path={path}"])
    before = data_spec(recipe.data_source())
    assert data_spec(recipe.data_source()) == before  # the same file is the same spec: its cache is reused
    path.write_text("Now is the winter of our discontent.\n" * 60)
    assert data_spec(recipe.data_source()) != before


def test_a_run_whose_dataset_lacks_the_text_column_stops_before_writing_anything(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "quickstart", "data.source=dataset", f"data.dataset={files['csv']}", "data.text_column=body",
                 "population.num_clients=4", "selection.clients_per_round=2", "--out", str(out)]) == 2
    said = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "error: data.text_column: " in said and "has no column 'body'; its columns: text, label, user" in said
    assert not out.exists()


def test_a_dirichlet_draw_that_cannot_meet_its_minimum_is_a_partitioner_error(files):
    recipe = recipe_for(files["jsonl"], "{name: dirichlet, by: label, alpha: 0.05, min_partition_size: 40}")
    with pytest.raises(ValueError, match="data.partitioner: The max number of attempts"):
        partitions(data_spec(recipe.data_source()))
