"""Local record files (jsonl): reading them, the clients a file names, and the facts file format's own checks.

Imports neither torch nor any tokenizer, so :func:`fedfusion.run.check.check_recipe` reads the files a recipe names
before a run writes anything: a malformed line, a probe naming a client with no records, or a client count that
is not ``population.num_clients`` stops it in about a second, with the file and the line.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from fedfusion.config.sections import RecipeError


def numbered_jsonl(path: str | Path, required: Sequence[str]) -> list[tuple[int, dict]]:
    """(line number, record) of every record of a jsonl file; a missing file, bad JSON or a record without a
    ``required`` field raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {number} is not JSON ({exc.msg})") from None
            missing = [f for f in required if not isinstance(record, dict) or f not in record]
            if missing:
                raise ValueError(f"{path}: line {number} has no field {missing[0]!r}")
            rows.append((number, record))
    if not rows:
        raise ValueError(f"{path}: no records")
    return rows


def read_jsonl(path: str | Path, required: Sequence[str]) -> list[dict]:
    """The records of a jsonl file, checked as :func:`numbered_jsonl` checks them."""
    return [record for _, record in numbered_jsonl(path, required)]


def client_documents(path: str | Path) -> dict[str, list[str]]:
    """Each client's documents from a training file (``client`` and ``text`` on every line), by client id."""
    docs: dict[str, list[str]] = defaultdict(list)
    for record in read_jsonl(path, ("client", "text")):
        docs[str(record["client"])].append(str(record["text"]))
    return dict(docs)


def client_order(ids: Iterable[str]) -> tuple[str, ...]:
    """Client ids in a stable order: numerically where every id is an integer, else as strings."""
    ids = list(ids)
    if all(i.lstrip("-").isdigit() for i in ids):
        return tuple(sorted(ids, key=int))
    return tuple(sorted(ids))


def natural_partition(path: str | None) -> dict[str, list[str]] | None:
    """A jsonl text file whose every record names its ``client``: each client's texts (the file's own
    partition), in :func:`client_order`; None for any other file, which is cut into equal shards."""
    if path is None or not str(path).endswith(".jsonl"):
        return None
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if '"client"' not in first:
        return None
    docs = client_documents(path)
    return {cid: docs[cid] for cid in client_order(docs)}


def check_client_count(path: str | Path | None, found: int, num_clients: int) -> None:
    """A file that partitions its records by ``client`` sets the population's size: RecipeError unless it is
    ``num_clients``."""
    if found != num_clients:
        raise RecipeError(f"population.num_clients: {path} holds {found} clients (its 'client' field); "
                         f"set population.num_clients={found}, got {num_clients}")


def read_probes(path: str | Path, owners: set[str], train: str | Path) -> list[dict]:
    """The probes of a facts dataset (the format of :mod:`fedfusion.data.facts`); a probe that names a client none
    of ``owners`` (the clients of the training file ``train``) or has an empty prompt or answer raises ValueError
    naming the probes file and its line."""
    rows = []
    for number, probe in numbered_jsonl(path, ("prompt", "answer", "client")):
        if str(probe["client"]) not in owners:
            raise ValueError(f"{path}: line {number}: client {str(probe['client'])!r} has no training records in "
                             f"{train}")
        if not str(probe["prompt"]).strip() or not str(probe["answer"]).strip():
            raise ValueError(f"{path}: line {number}: empty prompt or answer")
        rows.append(probe)
    return rows


def read_facts(train: str | Path, probes: str | Path) -> tuple[list[dict], list[dict]]:
    """The training records and the probes of a facts dataset's two files, checked line by line."""
    records = read_jsonl(train, ("client", "text"))
    return records, read_probes(probes, {str(r["client"]) for r in records}, train)
