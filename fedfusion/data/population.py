"""Who the virtual clients are: each one's text partition and device tier, derived from the recipe.

Server and clients compute the same population from the same (data spec, size, seed), so a client
needs only its partition id and the spec carried in the message, never server state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import overload

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from fedfusion.config.methods import LORA
from fedfusion.config.sections import DataConfig, DataSource, PopulationConfig
from fedfusion.data.cache import cached_tensor
from fedfusion.data.facts import (
    Facts,
    encode_documents,
    facts_from_records,
    facts_tokenizer,
    generate_facts,
    holder_groups,
    load_facts,
)
from fedfusion.data.federated import (
    PARTITIONS_FILE,
    PartitionSizes,
    check_columns,
    client_name,
    client_texts,
    file_versions,
    instruct_spec,
    label_column,
    partitions,
)
from fedfusion.data.records import check_client_count, natural_partition
from fedfusion.data.shards import Shards, text_shards
from fedfusion.data.text import encode_text, lm_windows, load_shakespeare_roles, load_tokenizer, split_text
from fedfusion.devices.catalog import assign_tiers


@dataclass(frozen=True)
class ClientData:
    """One client's local text: a name (e.g. play/speaker), training text and held-out continuation.

    With ``documents`` (data.source=facts) the client's data is whole documents, tokenised as such
    (:func:`fedfusion.data.facts.encode_documents`); ``train`` and ``held_out`` join them for display and sizes.
    """

    name: str
    train: str
    held_out: str
    documents: tuple[str, ...] = ()
    held_out_documents: tuple[str, ...] = ()


def data_spec(source: DataSource) -> str:
    """The JSON spec from which any process rebuilds the population's data and tokenises it (with the local
    files it reads, their sizes and times: a changed file is a new spec, so nothing cached under the old one is reused)."""
    spec = {"data": asdict(source.data), "num_clients": source.num_clients, "seed": source.seed,
            "tokenizer": source.tokenizer}
    if source.data.source == "dataset":
        spec["files"] = file_versions(source.data)
    elif source.data.source == "text":
        path = _text_path(source.data)
        stat = Path(path).stat()
        spec["files"] = [(path, stat.st_size, stat.st_mtime_ns)]
    return json.dumps(spec, sort_keys=True)


def _text_path(data: DataConfig) -> str:
    """The file of ``data.source=text`` (the recipe's validation requires it; a hand-made spec may lack it)."""
    if not data.path:
        raise ValueError("data.source=text needs data.path")
    return data.path


@dataclass(frozen=True)
class TextPopulation(Sequence[ClientData]):
    """The clients of ``data.source: text``: client ``i`` is shard ``i`` of the file, named ``shard-i``, read and
    split when asked (:mod:`fedfusion.data.shards`: a population holds no text per client)."""

    shards: Shards
    held_out: float

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, i: int) -> ClientData: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ClientData]: ...

    def __getitem__(self, i: int | slice) -> ClientData | Sequence[ClientData]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return ClientData(f"shard-{i % len(self)}", *split_text(self.shards[i], self.held_out))

    def names(self) -> tuple[str, ...]:
        """Every client's name, without reading a shard."""
        return tuple(f"shard-{i}" for i in range(len(self)))

    def sizes(self) -> PartitionSizes:
        """Each client's training characters, without reading a shard (they are all one size)."""
        train = len(split_text("x" * self.shards.size, self.held_out)[0])
        return PartitionSizes("characters", self.names(), (train,) * len(self))


@lru_cache(maxsize=4)
def population_data(spec: str) -> Sequence[ClientData]:
    """Every client's data for a spec from :func:`data_spec` (cached per process)."""
    parsed = json.loads(spec)
    data, num_clients, seed = DataConfig(**parsed["data"]), parsed["num_clients"], parsed["seed"]
    if data.source == "shakespeare":
        roles = load_shakespeare_roles(min_chars=data.min_chars)
        if len(roles) < num_clients:
            raise ValueError(
                f"population.num_clients: {num_clients} clients requested but only {len(roles)} "
                f"Shakespeare roles have data.min_chars={data.min_chars} characters"
            )
        picked = np.random.default_rng(seed).choice(len(roles), size=num_clients, replace=False)
        named = [(f"{roles[i].play}/{roles[i].speaker}", roles[i].text) for i in sorted(picked)]
    elif data.source == "facts":
        return _facts_clients(data, num_clients, seed)
    elif data.source == "dataset":
        named = client_texts(spec)
    elif (natural := natural_partition(data.path)) is not None:
        check_client_count(data.path, len(natural), num_clients)
        named = [(f"client-{cid}", "\n".join(docs)) for cid, docs in natural.items()]
    else:
        return TextPopulation(text_shards(_text_path(data), num_clients), data.held_out)
    return tuple(ClientData(name, *split_text(text, data.held_out)) for name, text in named)


def facts_data(data: DataConfig, num_clients: int, seed: int) -> Facts:
    """The facts of a data.source=facts recipe: the user's files, or biographies generated from the seed."""
    if data.path and data.probes:
        facts = load_facts(data.path, data.probes)
        check_client_count(data.path, len(facts.clients), num_clients)
        return facts
    records, probes, _ = generate_facts(num_clients, data.people, seed, data.skew)
    return facts_from_records(records, probes)


def _facts_clients(data: DataConfig, num_clients: int, seed: int) -> tuple[ClientData, ...]:
    """Each facts client: its documents, and its probes written out as held-out documents."""
    facts = facts_data(data, num_clients, seed)
    asked: dict[str, list[str]] = {c: [] for c in facts.clients}
    for p in facts.probes:
        asked[p.client].append(f"{p.prompt} {p.answer}")
    return tuple(ClientData(f"client-{cid}", "\n".join(docs), "\n".join(asked[cid]), docs, tuple(asked[cid]))
                 for cid, docs in zip(facts.clients, facts.documents))


def data_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer every process uses for a data spec: the word tokenizer built from a facts dataset's
    own files, else the model's (``model.pretrained``, or the fixed character tokenizer)."""
    parsed = json.loads(spec)
    if parsed["data"]["source"] == "facts" and not parsed["tokenizer"]:
        return _facts_tokenizer(spec)
    return load_tokenizer(parsed["tokenizer"])


@lru_cache(maxsize=4)
def _facts_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    parsed = json.loads(spec)
    return facts_tokenizer(facts_data(DataConfig(**parsed["data"]), parsed["num_clients"], parsed["seed"]))


def client_token_windows(spec: str, partition: int, seq_len: int, split: str) -> torch.Tensor:
    """Token windows of one client's ``train`` or ``held_out`` data: whole documents packed per window for
    facts, consecutive windows of the text otherwise."""
    clients = population_data(spec)
    if not 0 <= partition < len(clients):
        raise ValueError(f"partition-id {partition} is outside the population of {len(clients)} clients")
    client, tok = clients[partition], data_tokenizer(spec)
    if client.documents:
        return encode_documents(tok, client.documents if split == "train" else client.held_out_documents, seq_len)
    return lm_windows(encode_text(tok, getattr(client, split)), seq_len)


def tier_list(population: PopulationConfig, seed: int) -> list[str]:
    """Device tier of every client (seeded by the run's seed)."""
    return assign_tiers(population.mix, population.num_clients, seed)


def facts_by_tier(data: DataConfig, population: PopulationConfig, seed: int) -> tuple[Facts, dict[str, list[int]]]:
    """A facts recipe's facts, and its probes grouped by the tier :func:`tier_list` gives the client holding each
    (:func:`~fedfusion.data.facts.holder_groups`, tiers in the mix's order): the tier a simulated or ``fedfusion
    deploy`` node of that client reports."""
    facts = facts_data(data, population.num_clients, seed)
    return facts, holder_groups(facts.probes, facts.clients, tier_list(population, seed), list(population.mix))


def client_names(spec: str) -> tuple[str, ...]:
    """Every client's name (a text source's without reading its shards)."""
    clients = population_data(spec)
    return clients.names() if isinstance(clients, TextPopulation) else tuple(c.name for c in clients)


def pooled_held_out(spec: str, max_chars: int) -> str:
    """Held-out text of all clients, an equal share from each, at most ``max_chars`` in all; of a population larger
    than ``max_chars``, one character from each of ``max_chars`` clients evenly spread over it."""
    clients = population_data(spec)
    count = min(len(clients), max(1, max_chars))
    share = max(1, max_chars // count)
    return "\n".join(clients[i * len(clients) // count].held_out[:share] for i in range(count))


def partition_sizes(source: DataSource, method: str) -> PartitionSizes:
    """Each client's share of the data (every source, not only datasets), as plan and report show it; a
    ``method`` of LoRA counts instruction pairs (facts aside)."""
    from collections import Counter

    data = asdict(source.data)
    if method == LORA and source.data.source != "facts":
        from fedfusion.data.instruct import instruct_clients as pairs_of

        clients = pairs_of(lora_data_spec(source))
        label = "category" if source.data.source == "chatterbot" else label_column(data)
        return PartitionSizes("pairs", tuple(f"client-{i}" for i in range(len(clients))),
                              tuple(len(c.train) for c in clients), label,
                              tuple(dict(Counter(p.category for p in c.train)) for c in clients) if label else ())
    spec = data_spec(source)
    if source.data.source == "dataset":
        parts, label = partitions(spec), label_column(data)
        check_columns(parts[0], data, ("text_column",))
        names = tuple(client_name(data, i, p) for i, p in enumerate(parts))
        return PartitionSizes("rows", names, tuple(len(p) for p in parts), label,
                              tuple(dict(Counter(str(v) for v in p[label])) for p in parts) if label else ())
    people = population_data(spec)
    if isinstance(people, TextPopulation):
        return people.sizes()
    if source.data.source == "facts":
        return PartitionSizes("documents", tuple(c.name for c in people), tuple(len(c.documents) for c in people))
    return PartitionSizes("characters", tuple(c.name for c in people), tuple(len(c.train) for c in people))



def write_partition_sizes(run_path: Path, source: DataSource, method: str) -> None:
    """Write the run's partition sizes once (a resumed run keeps the file its first part wrote)."""
    path = Path(run_path) / PARTITIONS_FILE
    if not path.is_file():
        path.write_text(json.dumps(partition_sizes(source, method).as_dict()))


def lora_data_spec(source: DataSource) -> str:
    """The JSON spec from which server and clients rebuild the same instruction-pair partitions; for facts, the
    population's (:func:`data_spec`): its documents as token windows, trained with the language-model loss."""
    d = source.data
    if d.source == "facts":
        return data_spec(source)
    if d.source == "dataset":
        return instruct_spec(d, source.num_clients, source.seed)
    return json.dumps({"source": "chatterbot", "language": d.language, "num_clients": source.num_clients,
                       "split": d.split, "held_out": d.held_out, "seed": source.seed}, sort_keys=True)


def windows_spec(spec: str) -> bool:
    """Whether a client's data spec is :func:`data_spec`'s (token windows) rather than instruction pairs'."""
    return "data" in json.loads(spec)


@lru_cache(maxsize=64)
def client_windows(spec: str, partition: int, seq_len: int, split: str) -> torch.Tensor:
    """Token windows of one client's ``train`` or ``held_out`` text.

    Cached in memory (simulation's Ray actors persist) and on disk (a deployed node starts a fresh
    process per message).
    """
    return cached_tensor("windows", f"{spec}|{partition}|{seq_len}|{split}",
                         lambda: client_token_windows(spec, partition, seq_len, split))
