"""Datasets the way Flower and Hugging Face users have them (``data.source: dataset``).

A dataset is a Hugging Face ``datasets.Dataset``: a hub id (online users), local ``.jsonl``/``.json``/
``.csv``/``.parquet``/``.txt`` files (a path or a glob; a ``.txt`` file is one row per line, column ``text``), or a
built-in corpus as a table (``shakespeare``: one row per role with ``text``, ``play``, ``speaker``, ``role``;
``chatterbot``: one row per pair with ``prompt``, ``response``, ``category``). A flwr-datasets partitioner
(:mod:`fedfusion.data.partitioners`) splits it over ``population.num_clients`` clients, after a seeded shuffle
unless ``data.shuffle`` is false.

Every process rebuilds the same partitions from the data spec alone: loading, shuffling and partitioning are
deterministic for a given (dataset, spec, seed). Local files are converted to Arrow once, under the fedfusion
cache (:mod:`fedfusion.data.cache`), and reused by every later process.
"""

from __future__ import annotations

import glob
import json
import random
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedfusion.config.choices import BUILTIN_DATASETS
from fedfusion.data.partitioners import make_partitioner, partition_column

# local file suffix -> the Hugging Face builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def is_local(name: str) -> bool:
    """Whether ``data.dataset`` names local files rather than a hub id or a built-in corpus."""
    return Path(name).suffix in FILE_BUILDERS or Path(name).exists() or name.startswith(("/", "./", "../", "~"))


def local_files(name: str) -> list[str]:
    """The files a local ``data.dataset`` (a path or a glob) names, sorted; ValueError if none or mixed types."""
    files = sorted(glob.glob(str(Path(name).expanduser())))
    if not files:
        raise ValueError(f"{name}: no such file")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) > 1 or not suffixes <= set(FILE_BUILDERS):
        raise ValueError(f"{name}: expected files of one type among {', '.join(FILE_BUILDERS)}, got {sorted(suffixes)}")
    return files


def file_versions(data) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of each local file a ``data.dataset`` names, empty for a hub id or built-in; part
    of the data spec, so that a partition cached under it (token windows, fedfusion.data.cache) is rebuilt when a file
    changes."""
    if data.dataset in BUILTIN_DATASETS or not is_local(data.dataset):
        return []
    return [(f, (st := Path(f).stat()).st_size, st.st_mtime_ns) for f in local_files(data.dataset)]


def _builtin_table(name: str, data: dict[str, Any]):
    """A built-in corpus as a table: Shakespeare's roles of at least ``data.min_chars`` characters, or every
    chatterbot pair of ``data.language``."""
    from datasets import Dataset

    if name == "shakespeare":
        from fedfusion.data.text import load_shakespeare_roles

        roles = load_shakespeare_roles(min_chars=data["min_chars"])
        return Dataset.from_list([{"text": r.text, "play": r.play, "speaker": r.speaker, "role": f"{r.play}/{r.speaker}"}
                                  for r in roles])
    from fedfusion.data.pairs import load_chatterbot

    return Dataset.from_list([{"prompt": p.prompt, "response": p.response, "category": p.category}
                              for pairs in load_chatterbot(data["language"]).values() for p in pairs])


def load_table(data: dict[str, Any]):
    """``data.dataset`` as one ``datasets.Dataset`` (the ``data.dataset_split`` split of a hub dataset)."""
    import datasets

    from fedfusion.data.cache import cache_dir

    name = data["dataset"]
    datasets.disable_progress_bars()  # the run shows its own progress
    if name in BUILTIN_DATASETS:
        return _builtin_table(name, data)
    if is_local(name):
        files = local_files(name)
        return datasets.load_dataset(FILE_BUILDERS[Path(files[0]).suffix], data_files=files, split="train",
                                     cache_dir=str(cache_dir() / "datasets"))
    return datasets.load_dataset(name, data["subset"], split=data["dataset_split"])


def check_columns(table, data: dict[str, Any], needed: tuple[str, ...]) -> None:
    for key in needed:
        column = data[key] if key != "partitioner.by" else partition_column(data["partitioner"])
        if column is not None and column not in table.column_names:
            raise ValueError(f"data.{key}: {data['dataset']} has no column {column!r}; its columns: "
                             f"{', '.join(table.column_names)}")


@lru_cache(maxsize=4)
def partitions(spec: str) -> tuple[Any, ...]:
    """Every client's rows (a ``datasets.Dataset`` each) for a data spec ``{"data", "num_clients", "seed"}``."""
    parsed = json.loads(spec)
    data, num_clients, seed = parsed["data"], parsed["num_clients"], parsed["seed"]
    table = load_table(data)
    check_columns(table, data, ("partitioner.by", "label_column"))
    if len(table) < num_clients:
        raise ValueError(f"population.num_clients: {data['dataset']} has {len(table)} rows, fewer than the "
                         f"{num_clients} clients")
    if data["shuffle"]:
        table = table.shuffle(seed=seed)
    partitioner = make_partitioner(data["partitioner"], num_clients, seed)
    partitioner.dataset = table
    try:  # the natural partitioner reads its ids here
        found = partitioner.num_partitions
    except (ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"data.partitioner: {exc}") from None
    if found != num_clients:
        raise ValueError(f"population.num_clients: {data['dataset']} has {found} distinct "
                         f"{partition_column(data['partitioner'])!r} values (the natural partitions); "
                         f"set population.num_clients={found}, got {num_clients}")
    try:
        parts = tuple(partitioner.load_partition(i) for i in range(num_clients))
    except (ValueError, KeyError, IndexError) as exc:  # e.g. Dirichlet sampling that cannot meet min_partition_size
        raise ValueError(f"data.partitioner: {exc}") from None
    for i, part in enumerate(parts):
        if len(part) == 0:
            raise ValueError(f"data.partitioner: client {i} gets no rows of {data['dataset']} ({len(table)} rows for "
                             f"{num_clients} clients); use fewer clients or another partitioner")
    return parts


def client_name(data: dict[str, Any], index: int, part) -> str:
    """A client's name: its natural id (``by=value``) under the natural partitioner, else ``client-<index>``."""
    if data["partitioner"]["name"] == "natural":
        column = data["partitioner"]["by"]
        return f"{column}={part[0][column]}"
    return f"client-{index}"


def client_texts(spec: str) -> list[tuple[str, str]]:
    """(name, text) of every client: its rows' ``data.text_column`` joined by newlines."""
    data = json.loads(spec)["data"]
    parts = partitions(spec)
    check_columns(parts[0], data, ("text_column",))
    return [(client_name(data, i, p), "\n".join(str(t) for t in p[data["text_column"]])) for i, p in enumerate(parts)]


def instruct_clients(spec: str):
    """Every client's instruction pairs (:class:`fedfusion.data.pairs.ClientPairs`) from its rows'
    ``data.prompt_column`` and ``data.response_column``: a seeded ``data.held_out`` share of each client's
    pairs is held out (at least one when it has two or more), the rest it trains on."""
    from fedfusion.data.pairs import ClientPairs, Pair

    parsed = json.loads(spec)
    data, seed = parsed["data"], parsed["seed"]
    label = label_column(data)
    clients = []
    for i, part in enumerate(partitions(spec)):
        check_columns(part, data, ("prompt_column", "response_column"))
        pairs = [Pair(str(row[data["prompt_column"]]).strip(), str(row[data["response_column"]]).strip(),
                      str(row[label]) if label else "") for row in part]
        random.Random(f"{seed}:{i}").shuffle(pairs)
        held = min(len(pairs) - 1, max(1, round(len(pairs) * data["held_out"]))) if len(pairs) > 1 else 0
        clients.append(ClientPairs(tuple(pairs[held:]), tuple(pairs[:held]), tuple(sorted({p.category for p in pairs}))))
    return tuple(clients)


def label_column(data: dict[str, Any]) -> str | None:
    """The column whose skew plan and report show: ``data.label_column``, else what a label-based partitioner
    splits by (not the natural id, which every client holds one of by construction)."""
    if data.get("label_column"):
        return data["label_column"]
    partitioner = data.get("partitioner") or {}
    return partitioner.get("by") if partitioner.get("name") not in ("natural", "iid") else None


def instruct_spec(data, num_clients: int, seed: int) -> str:
    """The instruction-pair data spec of a ``data.source: dataset`` recipe (see :func:`instruct_clients`)."""
    return json.dumps({"source": "dataset", "data": asdict(data), "num_clients": num_clients, "seed": seed,
                       "files": file_versions(data)}, sort_keys=True)


@dataclass(frozen=True)
class PartitionSizes:
    """How a population's data is spread: each client's examples (in ``unit``) and, where the data has labels,
    each client's count per label."""

    unit: str
    names: tuple[str, ...]
    examples: tuple[int, ...]
    label: str | None = None
    labels: tuple[dict[str, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(sizes: PartitionSizes, bins: int = 8, width: int = 40) -> list[str]:
    """Text lines for a terminal: examples per client (min, median, max, a histogram) and the label skew."""
    ex = sorted(sizes.examples)
    lines = [f"data: {len(ex)} clients, {sum(ex):,} {sizes.unit} in all; per client min {ex[0]:,}, "
             f"median {ex[len(ex) // 2]:,}, max {ex[-1]:,}"]
    low, high = ex[0], ex[-1]
    step = max(1, -(-(high - low + 1) // bins))
    counts = [0] * (((high - low) // step) + 1)
    for n in ex:
        counts[(n - low) // step] += 1
    top = max(counts)
    for k, c in enumerate(counts):
        lines.append(f"  {low + k * step:>10,} - {low + (k + 1) * step - 1:>10,} | {'#' * max(c > 0, round(width * c / top)):<{width}} {c}")
    if sizes.labels:
        skew = label_skew(sizes)
        lines.append(f"labels ({sizes.label}): {skew['labels']} in all; per client {skew['mean_labels']:.1f} on average, "
                     f"its largest label holding {skew['mean_top_share']:.0%} of its {sizes.unit} on average")
    return lines


def label_skew(sizes: PartitionSizes) -> dict[str, float]:
    """How uneven the labels are: labels in all, mean labels per client, mean share of a client's largest label."""
    every = {label for counts in sizes.labels for label in counts}
    shares = [max(c.values()) / sum(c.values()) for c in sizes.labels if c]
    return {"labels": len(every), "mean_labels": sum(len(c) for c in sizes.labels) / len(sizes.labels),
            "mean_top_share": sum(shares) / len(shares)}


PARTITIONS_FILE = "partitions.json"  # in the run directory: the PartitionSizes of its population


def read_partition_sizes(run_path: Path) -> PartitionSizes | None:
    """The run's partition sizes, or None for a run directory written before they were recorded."""
    path = Path(run_path) / PARTITIONS_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return PartitionSizes(raw["unit"], tuple(raw["names"]), tuple(raw["examples"]), raw["label"], tuple(raw["labels"]))
