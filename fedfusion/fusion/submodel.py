"""Width slicing as a fusion method: each client trains a slice of the target, folded by selective averaging.

HeteroFL (static), FedRolex (rolling, optionally staggered), Federated Dropout (random), FjORD (ordered) and
``owned`` windows; the fold is :func:`fedfusion.rounds.fold` (the average, then the optional outer optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.fusion.base import Client, Fold, FusionMethod, Payload, State, TierCost, Update, state_norm, state_size
from fedfusion.models import config_aliases, full_state, wire_state
from fedfusion.ordered import ordered_fractions
from fedfusion.outer import OuterConfig, OuterOptimizer
from fedfusion.rounds import fold, owned_starts, plan_round
from fedfusion.slicing import SelectiveAverager, SlicePlan, extract, plan_slice, stage_update, sub_config
from fedfusion.wire import ModelSpec, OrderedSpec, RoleSpec, SliceSpec, Spec, merge

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # Flower's arrays are numpy: no bfloat16


class SliceWire:
    """How a target-shaped state travels: tied aliases left out, floats in the wire dtype (float16 halves the
    downlink; replies and the target stay float32)."""

    def __init__(self, config: PretrainedConfig, wire_dtype: str = "float32") -> None:
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
        self.dtype = WIRE_DTYPES[wire_dtype]
        self.aliases = config_aliases(config)  # tied keys messages leave out

    def __call__(self, state: State) -> State:
        """``state`` as a message carries it."""
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in wire_state(state, self.aliases).items()}


class SubModelMethod(FusionMethod):
    """Width-sliced partial training on a Llama-family (or GPT-2 / OPT / CNN) target.

    ``widths`` maps a tier to the fraction of every layer its clients hold. With ``stagger`` (rolling only) the
    sampled clients' windows are laid end to end around the axis in sample order, so a round covers
    min(1, sum of widths) of every layer instead of the widest window.
    """

    name, role, noun = "submodel", "submodel", "sub-model"

    def __init__(self, config: PretrainedConfig, widths: dict[str, float], template: State, *,
                 policy: str = "rolling", stride: float = 0.125, stagger: bool = False, run_seed: int = 0,
                 aggregate: str = "mean", trim: float = 0.2, axes: tuple[str, ...] | None = None, scale: bool = True,
                 ordered_ladder: tuple[float, ...] | None = None, ordered_distill: bool = False,
                 wire_dtype: str = "float32", outer: OuterConfig | None = None) -> None:
        self.config, self.widths, self.policy, self.stride = config, widths, policy, stride
        self.stagger, self.run_seed, self.aggregate, self.trim = stagger, run_seed, aggregate, trim
        self.axes, self.scale = axes, scale
        self.ordered_ladder = ordered_ladder or tuple(sorted(set(widths.values())))
        self.ordered_distill = ordered_distill
        self.wire = SliceWire(config, wire_dtype)
        # a damped server step on each round's fold (fedfusion.outer); None: plain selective averaging
        self.outer = OuterOptimizer(outer) if outer is not None and outer.method != "none" else None
        # sub-model sizes depend only on the width, so they are priced once per run
        self.costs = {tier: state_size(self.wire(extract(template, config, self._static(w))), w)
                      for tier, w in widths.items()}
        self.owned: dict[int, float] | None = None

    def _static(self, width: float) -> SlicePlan:
        return plan_slice(self.config, width, "static", axes=self.axes, scale=self.scale)

    def observe(self, population: Mapping[int, str]) -> None:
        """``owned`` windows tile the widths of every partition known so far that this method trains."""
        if self.policy == "owned":
            self.owned = owned_starts({p: self.widths[t] for p, t in population.items() if t in self.widths})

    def describe(self) -> str:
        return f"submodel: policy={self.policy} stride={self.stride} stagger={self.stagger} widths={self.widths}"

    def tier_cost(self, tier: str) -> TierCost:
        return self.costs[tier]

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        widths = [self.widths[c.tier] for c in clients]
        plans = plan_round(self.config, [(c.partition, w) for c, w in zip(clients, widths)], self.policy,
                           server_round, self.run_seed, self.stride, self.stagger, self.axes, self.scale, self.owned)
        out = []
        for client, width, plan in zip(clients, widths, plans):
            sent = self.wire(extract(target, self.config, plan))
            specs: list[Spec] = [RoleSpec(self.role), ModelSpec(sub_config(self.config, plan).to_dict()),
                                 SliceSpec(width, self.policy, self.axes or None)]
            if self.policy == "ordered":
                specs.append(OrderedSpec(tuple(ordered_fractions(width, self.ordered_ladder)), self.ordered_distill))
            spec = merge(*specs)
            out.append(Payload(client, sent, spec, width, params=sum(t.numel() for t in sent.values()),
                               sent_norm=state_norm(sent), assignment=plan.assignment(), context=(plan, target)))
        return out

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        plan, target = payload.context
        sub = wire_state(reply, self.wire.aliases)  # a stray alias is dropped
        norm = state_norm(sub)
        stage_update(target, self.config, self._from_wire(sub, plan, target), plan)  # raises on a bad key, shape or value
        return Update(payload, weight, norm, sub)

    def _from_wire(self, reply: State, plan: SlicePlan, target: State) -> State:
        """A reply as the averager takes it: tied aliases restored; with a float16 downlink, the reply's change
        from the float16 values sent is added to the exact float32 slice, so rounding the download loses no part
        of the update."""
        reply = full_state(reply, self.wire.aliases)  # aliases are rebuilt from what they alias
        if self.wire.dtype == torch.float32:
            return reply
        exact = extract(target, self.config, plan)
        sent = {k: v.to(self.wire.dtype).float() for k, v in exact.items()}
        return {k: exact[k] + (v.float() - sent[k]) if k in exact and v.shape == exact[k].shape else v
                for k, v in reply.items()}

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        averager = SelectiveAverager(target, self.config, self.aggregate, self.trim)
        for update in updates:
            plan, sent_from = update.payload.context
            averager.add(self._from_wire(update.data, plan, sent_from), plan, weight=update.weight)
        coverage = averager.coverage()
        return Fold(fold(averager, self.outer), coverage)

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        return self.wire(target), merge(RoleSpec(self.role), ModelSpec(self.config.to_dict()))

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is not None:
            if "outer" not in state:
                raise ValueError("the checkpoint holds no outer-optimizer state but fusion.outer is set: resuming "
                                 "would restart its momentum; resume with the recipe the run was started with")
            self.outer.load_state_dict(state["outer"])
