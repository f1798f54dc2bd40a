"""The recipe's ``data.partitioner``: which flwr-datasets partitioner splits a dataset over the clients.

A recipe names a partitioner and its parameters, e.g. ``{name: dirichlet, by: label, alpha: 0.3}``. ``by`` is
the column a partitioner reads (flwr-datasets' ``partition_by``); every other parameter keeps its
flwr-datasets name. The number of partitions is ``population.num_clients`` and the seed is the recipe's, so
neither is given here. Checking a spec imports nothing heavy (recipes are validated before torch loads);
:func:`make_partitioner` imports flwr-datasets.
"""

from __future__ import annotations

from typing import Any

# name -> (flwr-datasets class, required parameters, optional parameters with their types)
PARTITIONERS: dict[str, tuple[str, tuple[str, ...], dict[str, type | tuple[type, ...]]]] = {
    "iid": ("IidPartitioner", (), {}),
    "dirichlet": ("DirichletPartitioner", ("by", "alpha"),
                  {"min_partition_size": int, "self_balancing": bool, "shuffle": bool}),
    "shard": ("ShardPartitioner", ("by",),
              {"num_shards_per_partition": int, "shard_size": int, "keep_incomplete_shard": bool, "shuffle": bool}),
    "pathological": ("PathologicalPartitioner", ("by", "num_classes_per_partition"),
                     {"class_assignment_mode": str, "shuffle": bool}),
    "natural": ("NaturalIdPartitioner", ("by",), {}),
}
_TYPES: dict[str, type | tuple[type, ...]] = {"by": str, "alpha": (int, float), "num_classes_per_partition": int}
SEEDED = ("dirichlet", "shard", "pathological")  # partitioners that take the recipe's seed


def check_partitioner(spec: dict[str, Any]) -> None:
    """Raise ValueError naming the bad key of a partitioner spec (``name`` plus its parameters)."""
    name = spec.get("name")
    if name not in PARTITIONERS:
        raise ValueError(f"name: {name!r} is not one of {', '.join(PARTITIONERS)}")
    _, required, optional = PARTITIONERS[name]
    for key in required:
        if key not in spec:
            raise ValueError(f"{key}: the {name} partitioner needs it")
    types = {**_TYPES, **optional}
    for key, value in spec.items():
        if key == "name":
            continue
        if key not in required and key not in optional:
            known = ", ".join((*required, *optional)) or "none"
            raise ValueError(f"{key}: not a parameter of the {name} partitioner (its parameters: {known}; the "
                             "number of partitions is population.num_clients and the seed the recipe's)")
        if not isinstance(value, types[key]) or (types[key] is not bool and isinstance(value, bool)):
            raise ValueError(f"{key}: expected {getattr(types[key], '__name__', 'a number')}, got {value!r}")
    if name == "dirichlet" and spec["alpha"] <= 0:
        raise ValueError(f"alpha: must be > 0, got {spec['alpha']}")
    for key in ("num_shards_per_partition", "shard_size", "num_classes_per_partition"):
        if key in spec and spec[key] < 1:
            raise ValueError(f"{key}: must be >= 1, got {spec[key]}")


def partition_column(spec: dict[str, Any]) -> str | None:
    """The column the partitioner reads (None for iid)."""
    return spec.get("by")


def make_partitioner(spec: dict[str, Any], num_partitions: int, seed: int):
    """The flwr-datasets partitioner of a checked spec, for ``num_partitions`` clients."""
    import flwr_datasets.partitioner as fp

    check_partitioner(spec)
    cls, _, _ = PARTITIONERS[spec["name"]]
    kwargs = {("partition_by" if k == "by" else k): v for k, v in spec.items() if k != "name"}
    if spec["name"] != "natural":
        kwargs["num_partitions"] = num_partitions
    if spec["name"] in SEEDED:
        kwargs["seed"] = seed
    return getattr(fp, cls)(**kwargs)
