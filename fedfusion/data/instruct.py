"""Every client's instruction pairs from the JSON data spec a message carries: the chatterbot corpus
(:mod:`fedfusion.data.pairs`) or a dataset's pairs (:mod:`fedfusion.data.federated`)."""

from __future__ import annotations

import json
import random
from functools import lru_cache

from fedfusion.data.federated import instruct_clients as dataset_clients
from fedfusion.data.pairs import ClientPairs, Pair, load_chatterbot, partition_pairs, split_held_out


@lru_cache(maxsize=8)
def instruct_clients(spec: str) -> tuple[ClientPairs, ...]:
    """Every client's pairs from a JSON data spec ``{"source": "chatterbot", "language", "num_clients",
    "split", "held_out", "seed"}``; deterministic, so server and clients agree without exchanging data."""
    s = json.loads(spec)
    if s.get("source") == "dataset":
        return dataset_clients(spec)
    if s.get("source") != "chatterbot":
        raise ValueError(f"instruction data source must be 'chatterbot' or 'dataset', got {s.get('source')!r}")
    train, held = split_held_out(load_chatterbot(s.get("language", "english")), float(s.get("held_out", 0.1)),
                                 int(s.get("seed", 0)))
    return tuple(partition_pairs(train, held, int(s["num_clients"]), s.get("split", "category"),
                                 int(s.get("seed", 0))))


def pooled_held_out(spec: str, max_pairs: int | None = None) -> list[Pair]:
    """The held-out pairs of every category (each once), or of every client of a dataset, in a seeded order, at
    most ``max_pairs``."""
    s = json.loads(spec)
    if s.get("source") == "dataset":
        pairs = [p for c in instruct_clients(spec) for p in c.held_out]
        random.Random(int(s["seed"])).shuffle(pairs)
        return pairs[:max_pairs] if max_pairs else pairs
    _, held = split_held_out(load_chatterbot(s.get("language", "english")), float(s.get("held_out", 0.1)),
                             int(s.get("seed", 0)))
    pairs = [p for c in sorted(held) for p in held[c]]
    random.Random(int(s.get("seed", 0))).shuffle(pairs)
    return pairs[:max_pairs] if max_pairs else pairs
