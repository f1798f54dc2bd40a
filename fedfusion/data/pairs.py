"""Instruction pairs: the chatterbot corpus by category, its held-out share and its split among clients.

PyPI ``chatterbot-corpus`` holds YAML files of conversations, one file per category (ai, coding, trivia, ...).
Every consecutive pair of turns in a conversation is one (prompt, response) pair. Each category keeps a seeded
``held_out`` share of its pairs for evaluation. Clients split the rest either by category (``split="category"``:
natural non-IID, each client holds whole categories or a share of one) or by a seeded shuffle (``split="iid"``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

import yaml

from fedfusion.config.choices import CHAT_SPLITS


@dataclass(frozen=True)
class Pair:
    """One instruction: a prompt, the response to learn, and the category it came from."""

    prompt: str
    response: str
    category: str = ""



@dataclass(frozen=True)
class ClientPairs:
    """One client's instruction data: training pairs, held-out pairs and the categories they come from."""

    train: tuple[Pair, ...]
    held_out: tuple[Pair, ...]
    categories: tuple[str, ...]



# -- the corpus ---------------------------------------------------------------------------------------
# libyaml's parser where PyYAML was built with it: the same objects as yaml.safe_load (every file of every
# language compared), ten times faster (the corpus took ~2 s to parse)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=2)
def load_chatterbot(language: str = "english") -> dict[str, tuple[Pair, ...]]:
    """Every distinct (turn, next turn) pair of the chatterbot corpus in ``language``, by category (file
    name). Entries that are not a list of turns (one malformed trivia entry) are skipped; tech_support
    repeats 10 pairs about a hundred times each, which count once."""
    spec = find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("data.source=chatterbot needs the PyPI package chatterbot-corpus: "
                         "pip install --no-deps chatterbot-corpus==1.3.3")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / language
    if not folder.is_dir():
        raise ValueError(f"chatterbot-corpus has no language {language!r}")
    corpus = {}
    for path in sorted(folder.glob("*.yml")):
        conversations = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER).get("conversations") or []
        pairs = [
            Pair(str(turns[i]).strip(), str(turns[i + 1]).strip(), path.stem)
            for turns in conversations if isinstance(turns, list) for i in range(len(turns) - 1)
        ]
        if pairs:
            corpus[path.stem] = tuple(dict.fromkeys(pairs))  # repeated pairs once, first-seen order
    return corpus


def split_held_out(corpus: dict[str, tuple[Pair, ...]], held_out: float, seed: int
                   ) -> tuple[dict[str, list[Pair]], dict[str, list[Pair]]]:
    """(train, held-out) per category: a seeded shuffle of each category, its last ``held_out`` share
    (at least one pair when the category has two or more) held out."""
    if not 0 < held_out < 1:
        raise ValueError(f"held_out must be in (0, 1), got {held_out}")
    train, held = {}, {}
    for category in sorted(corpus):
        pairs = list(corpus[category])
        random.Random(f"{seed}:{category}").shuffle(pairs)
        n = min(len(pairs) - 1, max(1, round(len(pairs) * held_out))) if len(pairs) > 1 else 0
        train[category], held[category] = pairs[: len(pairs) - n], pairs[len(pairs) - n:]
    return train, held


def partition_pairs(train: dict[str, list[Pair]], held: dict[str, list[Pair]], num_clients: int,
                    split: str, seed: int) -> list[ClientPairs]:
    """Deal the pairs out to ``num_clients`` clients.

    ``category``: with at most as many clients as categories, client i holds categories i, i + n, ...
    (sorted by name); with more clients, client i holds a seeded share of category i mod C, shared with the
    other clients of that category, and that category's held-out pairs. ``iid``: a seeded shuffle of every
    pair dealt round-robin.
    """
    if split not in CHAT_SPLITS:
        raise ValueError(f"data split must be one of {', '.join(CHAT_SPLITS)}, got {split!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    categories = sorted(c for c in train if train[c])
    if not categories:
        raise ValueError("no training pairs to partition")
    rng = random.Random(seed)
    if split == "iid":
        pairs = [p for c in categories for p in train[c]]
        rng.shuffle(pairs)
        held_pairs = [p for c in categories for p in held.get(c, [])]
        rng.shuffle(held_pairs)
        clients = [ClientPairs(tuple(pairs[i::num_clients]), tuple(held_pairs[i::num_clients]), tuple(categories))
                   for i in range(num_clients)]
    elif num_clients <= len(categories):
        clients = []
        for i in range(num_clients):
            mine = categories[i::num_clients]
            clients.append(ClientPairs(tuple(p for c in mine for p in train[c]),
                                       tuple(p for c in mine for p in held.get(c, [])), tuple(mine)))
    else:
        members = {c: [i for i in range(num_clients) if categories[i % len(categories)] == c] for c in categories}
        clients = []
        for i in range(num_clients):
            c = categories[i % len(categories)]
            pairs = list(train[c])
            random.Random(f"{seed}:{c}:shares").shuffle(pairs)
            share = members[c].index(i)
            clients.append(ClientPairs(tuple(pairs[share::len(members[c])]), tuple(held.get(c, [])), (c,)))
    for i, client in enumerate(clients):
        if not client.train:
            raise ValueError(
                f"client {i} ({', '.join(client.categories)}) gets no training pair; use fewer clients or split=iid"
            )
    return clients

