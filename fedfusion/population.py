"""Who the virtual clients are: each one's text partition and device tier, derived from the recipe.

Server and clients compute the same population from the same (data spec, size, seed), so a client
needs only its partition id and the spec carried in the message, never server state.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from fedfusion.data import load_shakespeare_roles, load_text_file, split_text
from fedfusion.devices import assign_tiers
from fedfusion.recipe import DataConfig, Recipe


@dataclass(frozen=True)
class ClientData:
    """One client's local text: a name (e.g. play/speaker), training text and held-out continuation."""

    name: str
    train: str
    held_out: str


def data_spec(recipe: Recipe) -> str:
    """The JSON spec from which any process rebuilds the population's data and tokenises it."""
    return json.dumps(
        {"data": asdict(recipe.data), "num_clients": recipe.population.num_clients, "seed": recipe.seed,
         "tokenizer": recipe.model.pretrained},
        sort_keys=True,
    )


@lru_cache(maxsize=4)
def population_data(spec: str) -> tuple[ClientData, ...]:
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
    else:
        text = load_text_file(data.path)
        size = len(text) // num_clients
        named = [(f"shard-{i}", text[i * size : (i + 1) * size]) for i in range(num_clients)]
    return tuple(ClientData(name, *split_text(text, data.held_out)) for name, text in named)


def tier_list(recipe: Recipe) -> list[str]:
    """Device tier of every client (seeded by the recipe)."""
    return assign_tiers(recipe.population.mix, recipe.population.num_clients, recipe.seed)


def pooled_held_out(spec: str, max_chars: int) -> str:
    """Held-out text of all clients, an equal share from each, at most ``max_chars`` in all."""
    clients = population_data(spec)
    share = max(1, max_chars // len(clients))
    return "\n".join(c.held_out[:share] for c in clients)
