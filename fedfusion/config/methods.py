"""The method registry: one entry per fusion method, the only place outside a method's own folder and its client
roles that names it.

Every list of methods is read from here: ``config.choices.FUSION_METHODS`` and ``MIXABLE``, the client roles
(``wire.specs.ROLES``), the fold order of a mixed round (``fusion.rounds.FOLD_ORDER``), the builders
(``run.federation.build_methods``), the plan (``fedfusion plan``: each entry's view, ``fusion.<name>.plan``; a mixed
federation's in ``analysis.plan``), the server's priced work (``run.federation``, ``run.check``,
``analysis.report``), a central method's course (``run.central``), the arms ``fedfusion compare`` runs
(``run.arms``). An entry is pure data: its hooks are ``"module:function"`` paths, imported only where they are
called (:func:`hook`), so loading a recipe still imports nothing of fedfusion's implementation and no torch (the
recipe composes the methods' own sections, each entry's ``section``, from their folders' ``config`` modules, which
import only ``config``).

Adding a method: its folder ``fedfusion/fusion/<name>/`` (the method, its ``build``, its plan view ``plan.py`` and,
where it has settings of its own, its recipe section ``config.py`` with its rules across sections, and, where its
roles read a spec of its own, its message specs ``spec.py``), its client role module(s) in ``clients/``, and one
entry below.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

SUBMODEL = "submodel"
DISTILL = "distill"
LORA = "lora"
GENERATIVE = "generative"
MIXED = "mixed"
UNITS = "units"
WINDOW = "window"  # the client role of a full-forward window (SUBMODEL with fusion.forward=full)


@dataclass(frozen=True)
class Method:
    """One fusion method (``fusion.method``) as the rest of the package sees it."""

    name: str
    # the client roles that train its payloads (RoleSpec.role -> module of fedfusion.clients), the main one first
    roles: tuple[tuple[str, str], ...] = ()
    fold_rank: int | None = None  # where a mixed round folds it (lower first); None: not folded by fusion.rounds
    mixable: bool = False  # fusion.method=mixed may give it tiers (it trains the whole target)
    slices: bool = False  # its tiers train a width slice of the target: each needs fusion.widths (or auto_widths)
    server_device: str = ""  # the recipe section whose ``server_device`` prices the server's own training
    server_work: str = ""  # what the report calls that training
    # "module:function" (the recipe sections it names, target, tiers) -> FusionMethod, called by :func:`call`
    build: str = ""
    # "module:function" (the recipe sections it names, source; a mixed view: part, each method's part of it) ->
    # fedfusion.fusion.plan.PlanView: what ``fedfusion plan`` prints, called by :func:`call`
    plan: str = ""
    # mixable: "module:function" (the recipe sections it names, source, usable, tiers) -> (its tiers' plan rows, its
    # server's row or None): its part of a mixed federation's plan (fedfusion.analysis.plan.mixed_plan_table)
    mixed_plan: str = ""
    grows: bool = False  # fusion.grow_round applies to it (its first rounds train the smallest slice, then grow)
    report_note: str = ""  # "module:NAME": a sentence the report adds under "Who did the work" of a run of it
    trained: str = ""  # "module:function" (ledger row) -> what a client of it trained, as the report says
    policy_in_label: bool = False  # a run's header names it with fusion.policy ("submodel/rolling")
    # "module:function" (recipe, run directory) -> run.central.CentralMethod: the server trains the target step by
    # step, nodes compute parts of each step (no fusion rounds); empty: the fusion strategy's rounds
    central: str = ""
    # "module:function" (recipe) -> (smallest-only Arm, oracle Arm): what `fedfusion compare` runs beside a recipe of
    # it (fedfusion.run.arms); empty: compare refuses the method
    arms: str = ""
    home: str = ""  # its folder (package): fedfusion.fusion.<name> unless given
    # "module:Class" of its recipe section, in its folder's ``config`` module (on the config floor): the recipe's
    # ``<name>:`` section (fedfusion.config.recipe composes it; ``CHOICES`` on the class: its keys' allowed values;
    # ``WHOLE``: its mappings a recipe states whole)
    section: str = ""
    # "module:Class" of the message specs its roles read, in its folder's ``spec`` module (on the wire floor)
    specs: tuple[str, ...] = ()
    # "module:function" (the recipe sections it names, tiers: the tiers that train it) -> None: its rules across
    # sections, raising RecipeError, in its folder's ``config`` module; checked after its section's own ``check``
    rules: str = ""
    facts: bool = False  # it trains on data.source=facts
    # why Flower's clipping DP mods (privacy.mode clip / local) cannot apply to its replies; empty: they can
    unclipped: str = ""

    @property
    def package(self) -> str:
        return self.home or f"fedfusion.fusion.{self.name}"


# The order of fusion.method's choices (error messages list them in it); FOLD_ORDER: the slice average first (what
# devices trained of the target itself), then LoRA's update, then the server-side methods that train the whole
# target from what devices sent (generative samples, then distillation from the family models).
METHODS: tuple[Method, ...] = (
    Method(SUBMODEL, roles=((SUBMODEL, "fedfusion.clients.submodel"), (WINDOW, "fedfusion.clients.window")),
           fold_rank=0, mixable=True, slices=True, build="fedfusion.fusion.submodel.build:build",
           plan="fedfusion.fusion.submodel.plan:slices_view", mixed_plan="fedfusion.fusion.submodel.plan:mixed_rows",
           grows=True, policy_in_label=True, facts=True,
           arms="fedfusion.run.arms:slicing_arms"),
    Method(DISTILL, roles=(("smallmodel", "fedfusion.clients.smallmodel"),), fold_rank=3, mixable=True,
           server_device=DISTILL, server_work="the server's distillation",
           build="fedfusion.fusion.distill.build:build", plan="fedfusion.fusion.distill.plan:distill_view",
           mixed_plan="fedfusion.fusion.distill.plan:mixed_rows",
           arms="fedfusion.run.arms:distill_arms", section="fedfusion.fusion.distill.config:DistillConfig",
           rules="fedfusion.fusion.distill.config:check_across",
           specs=("fedfusion.fusion.distill.spec:FamilySpec",)),
    Method(LORA, roles=((LORA, "fedfusion.clients.lora"),), fold_rank=1, build="fedfusion.fusion.lora.build:build",
           plan="fedfusion.fusion.lora.plan:lora_view", arms="fedfusion.run.arms:lora_arms", facts=True,
           section="fedfusion.fusion.lora.config:LoRAConfig", rules="fedfusion.fusion.lora.config:check_across",
           specs=("fedfusion.fusion.lora.spec:LoRABaseSpec", "fedfusion.fusion.lora.spec:QuantizeSpec",
                  "fedfusion.fusion.lora.spec:AdapterSpec")),
    Method(GENERATIVE, roles=((GENERATIVE, "fedfusion.clients.generative"),), fold_rank=2, mixable=True, slices=True,
           server_device=GENERATIVE, server_work="the server's training on the samples",
           build="fedfusion.fusion.generative.build:build", plan="fedfusion.fusion.generative.plan:generative_view",
           mixed_plan="fedfusion.fusion.generative.plan:mixed_rows", grows=True,
           report_note="fedfusion.fusion.generative.report:NOTE", trained="fedfusion.fusion.generative.report:trained",
           arms="fedfusion.run.arms:slicing_arms", section="fedfusion.fusion.generative.config:GenerativeConfig",
           specs=("fedfusion.fusion.generative.spec:GenerativeSpec",), facts=True,
           unclipped="a generative client replies samples; use privacy.mode=dp_sgd (its samples are drawn from a "
                     "DP-trained model)"),
    Method(MIXED, plan="fedfusion.analysis.plan:mixed_view", home="fedfusion.config.methods",  # tiers: fusion.tiers
           arms="fedfusion.run.arms:mixed_arms"),
    Method(UNITS, roles=((UNITS, "fedfusion.clients.units"),), plan="fedfusion.analysis.units_plan:units_view",
           central="fedfusion.run.units:UnitsMethod",
           # units.server_device prices its server (fedfusion.units.ledger); compare refuses it (units_arms says why)
           server_device=UNITS, home="fedfusion.units", arms="fedfusion.run.arms:units_arms"),
)
BY_NAME = {m.name: m for m in METHODS}
FUSION_METHODS = tuple(BY_NAME)
MIXABLE = tuple(m.name for m in METHODS if m.mixable)
SLICES = tuple(m.name for m in METHODS if m.slices)
GROWS = tuple(m.name for m in METHODS if m.grows)
FOLD_ORDER = tuple(m.name for m in sorted((m for m in METHODS if m.fold_rank is not None), key=lambda m: m.fold_rank or 0))
ROLES = {role: module for m in METHODS for role, module in m.roles}
CENTRAL = tuple(m.name for m in METHODS if m.central)
FACTS = tuple(m.name for m in METHODS if m.facts)
# the methods whose server trains, by what the run prices when several are mixed: the last to fold first
SERVER_WORK = {m.name: m.server_work for m in sorted(METHODS, key=lambda m: -(m.fold_rank or 0)) if m.server_work}


def method(name: str) -> Method:
    """The registry entry of ``name`` (a KeyError for an unknown one: the recipe checked it)."""
    return BY_NAME[name]


def hook(path: str) -> Any:
    """What a ``"module:name"`` path of an entry names (a function, or a constant), imported now."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def call(path: str, recipe: object, **given: Any) -> Any:
    """Call the hook at ``path`` with what its parameters name: each from ``given``, else the recipe's section (or
    top-level field) of that name. A hook so takes only the sections it reads, and its signature says which
    (``build(fusion, seed, target, tiers)``)."""
    fn = hook(path)
    return fn(**{name: given[name] if name in given else getattr(recipe, name)
                 for name in inspect.signature(fn).parameters})
