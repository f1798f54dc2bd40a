"""Width slicing as a fusion method: each client trains a slice of the target, folded by selective averaging.

HeteroFL (static), FedRolex (rolling, optionally staggered), Federated Dropout (random), FjORD (ordered) and
``owned`` windows; the fold is :func:`fedfusion.fusion.rounds.fold` (the average, then the optional outer optimizer).

Two forward passes: ``slice`` (a client runs its slice as a small model of its own, as HeteroFL and FedRolex do)
and ``full`` (a client holds the whole target frozen, sent in ``frozen`` format, and trains its slice's
coordinates with the exact gradient of the target's loss: :mod:`fedfusion.models.full_forward`; with
``window_rank`` r its trainable part is instead a rank-r update of every matrix, :mod:`fedfusion.models.low_rank`). With
``grow_round`` the run first trains what every device holds, the smallest width's static prefix of a target
silenced around it (:func:`fedfusion.models.growth.silence`: the target *is* that small model, so these rounds
are smallest-only training), and from the next round on trains the whole grown target under its own policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.config.choices import CORE_FORWARDS, FORWARDS
from fedfusion.config.methods import WINDOW
from fedfusion.devices.energy import frozen_work_params
from fedfusion.fusion.base import Client, Fold, FusionMethod, Payload, State, TierCost, Update, state_norm, state_size
from fedfusion.fusion.outer import OuterConfig, OuterOptimizer
from fedfusion.fusion.rounds import fold, owned_starts, plan_round
from fedfusion.models.build import config_aliases, full_state, wire_state
from fedfusion.models.full_forward import window_axes, with_core
from fedfusion.models.growth import grown_plan, silence
from fedfusion.models.low_rank import densify, factor_params, split
from fedfusion.models.slicing import (
    SelectiveAverager,
    SlicePlan,
    extract,
    plan_slice,
    scatter,
    sliced_shape,
    stage_update,
    sub_config,
    tensor_slices,
)
from fedfusion.train.ordered import ordered_fractions
from fedfusion.wire import secagg
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import INDEX_KEY, Wire, encode, pack_index
from fedfusion.wire.specs import ModelSpec, OrderedSpec, RoleSpec, SliceSpec, Spec, WindowSpec, WireSpec, merge


class SliceWire:
    """How a target-shaped state travels: tied aliases left out, down and up as ``wire`` says
    (:mod:`fedfusion.wire.quantize`); the target stays float32."""

    def __init__(self, config: PretrainedConfig, wire: Wire | None = None) -> None:
        self.formats = wire or Wire()
        self.aliases = config_aliases(config)  # tied keys messages leave out

    def exact(self, state: State) -> State:
        """``state`` without its tied aliases, in float32: what the server keeps of a payload."""
        return {k: v.float() if v.is_floating_point() else v for k, v in wire_state(state, self.aliases).items()}

    def __call__(self, state: State) -> State:
        """``state`` as a message carries it down."""
        return self.formats.send(self.exact(state))

    def cost(self, state: State, width: float) -> TierCost:
        """Parameters and bytes each way of ``state`` (a quantised reply has the payload's shapes)."""
        exact = self.exact(state)
        up = state_size(encode(exact, self.formats.up)).nbytes
        return replace(state_size(self(state), width), params=sum(t.numel() for t in exact.values()), nbytes_up=up)

    def index(self, target: State, config: PretrainedConfig, plan: SlicePlan, sent: State) -> torch.Tensor:
        """The target coordinates of every array sent (:func:`fedfusion.wire.quantize.pack_index`), so a client keeps
        its uplink residual where it belongs in the target while its window moves."""
        ids = {name: i for i, name in enumerate(sorted(target))}
        out = {}
        for name, sl in tensor_slices(target, config, plan).items():
            if sl.sub_name in sent:
                dims = sl.index + (None,) * (sent[sl.sub_name].dim() - len(sl.index))
                out[sl.sub_name] = (ids[name], dims)
        return pack_index(out)


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
                 wire: Wire | None = None, outer: OuterConfig | None = None, forward: str = "slice",
                 frozen: str = "int8", window_shared: bool = False, grow_round: int = 0,
                 window_widths: dict[str, float] | None = None, window_rank: int = 0, window_core: bool = False,
                 core_forward: str = "full", outside_core: bool = False, lr_power: float = 0.0,
                 expand: frozenset[str] = frozenset()) -> None:
        if forward not in FORWARDS:
            raise ValueError(f"forward {forward!r} is not one of {', '.join(FORWARDS)}")
        if window_rank < 0 or (window_rank and forward != "full"):
            raise ValueError(f"window_rank {window_rank}: a rank >= 1 trains low-rank updates in the full forward pass")
        if window_rank and (wire or Wire()).up != "float32":
            raise ValueError("window_rank: a low-rank reply (its factors) travels up in float32; set wire up to float32")
        if forward == "full" and policy == "ordered":
            raise ValueError("policy 'ordered' trains nested sub-models in their own forward pass; use forward 'slice'")
        self.forward, self.frozen, self.window_shared, self.grow_round = forward, frozen, window_shared, grow_round
        self.window_axes = window_axes(config, axes)
        self.window_rank = window_rank
        if window_core and (forward != "full" or window_rank):
            raise ValueError("window_core: a window of units (forward full, no window_rank) adds the smallest slice's units")
        self.window_core = window_core  # every window also trains the smallest width's units (the small model's)
        if lr_power and not (0 < lr_power <= 1 and forward == "full" and not window_rank):
            raise ValueError(f"lr_power {lr_power}: a power in [0, 1] for a window of units (forward full, no window_rank)")
        self.lr_power = lr_power  # a window of a fraction f of the units trains at lr x f^-lr_power
        if core_forward not in CORE_FORWARDS or (core_forward == "small" and not (window_core and window_shared)):
            raise ValueError(f"core_forward {core_forward!r}: one of {', '.join(CORE_FORWARDS)}; 'small' needs "
                             "window_core and window_shared (the small model whole inside every window)")
        self.core_forward = core_forward  # small: the core trains in the small model's own forward pass
        # each window drawn from the units outside the core, so core + window has one size every round (owned
        # windows tile the units outside the core already)
        self.outside_core = outside_core and window_core and policy != "owned"
        self.expand = expand  # tiers whose memory holds the frozen target in float32 (WindowSpec.expand)
        # low rank: (matrices trained as rank-r updates, tensors trained exactly), fixed for the run
        self.low_rank = split(config, wire_state(template, config_aliases(config)), window_shared) if window_rank else ([], [])
        # full forward: each tier's window, as a fraction of the units (default: the tier's width)
        self.window_widths = {t: (window_widths or {}).get(t, w) for t, w in widths.items()}
        self.config, self.widths, self.policy, self.stride = config, widths, policy, stride
        self.stagger, self.run_seed, self.aggregate, self.trim = stagger, run_seed, aggregate, trim
        self.axes, self.scale = axes, scale
        # the model every device holds before growth (and a core window's units): the smallest width's static prefix
        self.small = grown_plan(plan_slice(config, min(widths.values()), "static", axes=axes))
        self.ordered_ladder = ordered_ladder or tuple(sorted(set(widths.values())))
        self.ordered_distill = ordered_distill
        self.wire = SliceWire(config, wire)
        # a damped server step on each round's fold (fedfusion.fusion.outer); None: plain selective averaging
        self.outer = OuterOptimizer(outer) if outer is not None and outer.method != "none" else None
        self.target_params = sum(t.numel() for t in self.wire.exact(template).values())
        self.frozen_bytes = state_size(encode(self.wire.exact(template), frozen)).nbytes if forward == "full" else 0
        # sub-model sizes depend only on the width, so they are priced once per run
        # core_forward small: each step also trains the small model in its own forward pass (all of its work)
        self.core_work = sum(t.numel() for t in self.wire.exact(extract(template, config, self.small)).values()
                             ) if core_forward == "small" else 0
        self.costs = {tier: self._cost(template, tier) for tier in widths}
        self.owned: dict[int, float] | None = None

    def _static(self, width: float) -> SlicePlan:
        return plan_slice(self.config, width, "static", axes=self.axes, scale=self.scale)

    def _cost(self, template: State, tier: str) -> TierCost:
        """A tier's round after growth (the grow rounds train the smallest slice: cheaper, priced as this)."""
        if self.forward == "slice":
            return self.wire.cost(extract(template, self.config, self._static(self.widths[tier])), self.widths[tier])
        if self.window_rank:
            return self._low_rank_cost(template)
        width = self.window_widths[tier]
        plan = replace(plan_slice(self.config, self._window_fraction(width), "static", axes=self.window_axes, scale=False),
                       shared=self.window_shared)
        window = self.wire.cost(extract(template, self.config, plan), width)
        return replace(window, params=frozen_work_params(self.target_params, window.params) + self.core_work,
                       nbytes=window.nbytes + self.frozen_bytes)

    def _low_rank_cost(self, template: State) -> TierCost:
        """A low-rank round: the frozen target and the exact tensors down, the factors and the exact tensors up (float32)."""
        factored, exact = self.low_rank
        trained = factor_params(template, factored, self.window_rank) + sum(template[n].numel() for n in exact)
        down = state_size(self.wire.formats.send({n: template[n] for n in exact}), 1.0)
        return replace(down, params=frozen_work_params(self.target_params, trained),
                       nbytes=down.nbytes + self.frozen_bytes, nbytes_up=4 * trained)

    def begin(self, target: State) -> State:
        """With ``grow_round``, the target silenced around the smallest slice (:func:`fedfusion.models.growth.silence`)."""
        return silence(self.config, self.small, target) if self.grow_round else target

    def _plans(self, server_round: int, clients: Sequence[Client]) -> tuple[list[SlicePlan], list[float], bool]:
        """This round's plans, widths and whether clients run the whole target (full forward)."""
        if server_round <= self.grow_round:
            return [self.small] * len(clients), [min(self.widths.values())] * len(clients), False
        full = self.forward == "full"
        if self.window_rank:  # every unit, in low rank
            whole = replace(plan_slice(self.config, 1.0, "static", axes=self.window_axes, scale=False), shared=True)
            return [whole] * len(clients), [1.0] * len(clients), True
        widths = [(self.window_widths if full else self.widths)[c.tier] for c in clients]
        plans = plan_round(self.config, [(c.partition, w) for c, w in zip(clients, widths)], self.policy,
                           server_round, self.run_seed, self.stride, self.stagger, self.window_axes if full else self.axes,
                           self.scale and not full, self.owned,
                           skip=min(self.widths.values()) if full and self.outside_core else 0.0)
        return ([self._window(p) for p in plans] if full else plans), widths, full

    def _window(self, plan: SlicePlan) -> SlicePlan:
        """A full-forward window from a plan of units: the shared tensors as ``window_shared`` says, the smallest
        slice's units added with ``window_core``."""
        plan = replace(plan, shared=self.window_shared)
        return with_core(plan, self.small) if self.window_core else plan

    def observe(self, population: Mapping[int, str]) -> None:
        """``owned`` windows tile the widths (full forward: the window widths) of every partition known so far that
        this method trains; with ``window_core`` they tile the units outside the core, which every window trains."""
        if self.policy == "owned":
            widths = self.window_widths if self.forward == "full" else self.widths
            floor = min(self.widths.values()) if self.window_core else 0.0
            self.owned = owned_starts({p: widths[t] for p, t in population.items() if t in widths}, floor)

    def describe(self) -> str:
        grow = f" grow_round={self.grow_round}" if self.grow_round else ""
        full = f" forward=full frozen={self.frozen}" if self.forward == "full" else ""
        full += f" window_rank={self.window_rank}" if self.window_rank else ""
        full += " window_core" + (" outside_core" if self.outside_core else "") if self.window_core else ""
        full += " core_forward=small" if self.core_forward == "small" else ""
        full += f" window_lr_power={self.lr_power:g}" if self.lr_power else ""
        return f"submodel: policy={self.policy} stride={self.stride} stagger={self.stagger} widths={self.widths}{grow}{full}"

    def tier_cost(self, tier: str) -> TierCost:
        return self.costs[tier]

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        plans, widths, full = self._plans(server_round, clients)
        frozen = {FROZEN + k: v for k, v in encode(self.wire.exact(target), self.frozen).items()} if full else {}
        policy = "static" if server_round <= self.grow_round else self.policy
        low_rank = full and self.window_rank > 0
        feedback = self.wire.formats.error_feedback and not full  # a residual keyed by window would not follow it
        slices: dict[SlicePlan, tuple[State, State, float]] = {}  # clients of one plan share its tensors (one copy)
        out = []
        for client, width, plan in zip(clients, widths, plans):
            lr_scale = self._lr_scale(width) if full else 1.0  # a low-rank window has no lr_power (refused above)
            if plan not in slices:
                slices[plan] = self._slice(target, plan, low_rank, feedback)
            exact, sent, norm = slices[plan]
            trained = sum(t.numel() for t in exact.values())
            trained += factor_params(target, self.low_rank[0], self.window_rank) if low_rank else 0
            specs: list[Spec] = [SliceSpec(width, policy, self.axes or None), WireSpec(self.wire.formats.up, feedback)]
            if full:
                core = self.small.assignment() if self.core_forward == "small" else {}
                window = WindowSpec(plan.assignment(), plan.shared, self.window_rank, core, client.tier in self.expand)
                specs += [RoleSpec(WINDOW), ModelSpec(self.config.to_dict()), window]
            else:
                specs += [RoleSpec(self.role), ModelSpec(sub_config(self.config, plan).to_dict())]
            if policy == "ordered":
                specs.append(OrderedSpec(tuple(ordered_fractions(width, self.ordered_ladder)), self.ordered_distill))
            out.append(Payload(client, {**sent, **frozen}, merge(*specs), width,
                               params=frozen_work_params(self.target_params, trained) + self.core_work if full
                               else trained,
                               sent_norm=norm, assignment=plan.assignment(), context=(plan, target, low_rank),
                               row=self._row(trained, full) | ({"lr_scale": lr_scale} if self.lr_power else {}),
                               lr_scale=lr_scale))
        return out

    def _window_fraction(self, width: float) -> float:
        """The fraction of the units a window of ``width`` trains: with ``window_core`` the core's too, counted as
        disjoint from the window (exactly so with ``window_outside_core``; an overlap makes it an upper bound)."""
        core = min(self.widths.values()) if self.window_core else 0.0
        return min(1.0, width + core)

    def _lr_scale(self, width: float) -> float:
        """How much faster than the recipe's lr a window of ``width`` trains: ``f^-lr_power`` for the fraction f of
        the units it trains (:meth:`_window_fraction`)."""
        return self._window_fraction(width) ** -self.lr_power

    def _slice(self, target: State, plan: SlicePlan, low_rank: bool, feedback: bool) -> tuple[State, State, float]:
        """(the exact float32 tensors a client of ``plan`` trains, the arrays its message carries of them, the norm
        a reply's is judged against): the same for every client of the plan, so they share one copy."""
        exact = self.wire.exact(extract(target, self.config, plan))
        norm = state_norm(exact)  # low rank: the densified target's
        if low_rank:  # the factors start on the device; only the exactly trained tensors travel
            exact = {n: exact[n] for n in self.low_rank[1]}
        sent = self.wire.formats.send(exact)
        if self.wire.formats.up != "float32" and feedback:
            sent[INDEX_KEY] = self.wire.index(target, self.config, plan, exact)
        return exact, sent, norm

    def _row(self, trained: int, full: bool) -> dict[str, Any]:
        """The ledger's extra fields for a grow-then-fuse or full-forward run (none for plain slicing: its rows stay
        as they were): parameters trained (``params`` prices the work) and the forward pass."""
        if not self.grow_round and self.forward == "slice":
            return {}
        return {"trained_params": trained, "forward": "full" if full else "slice"}

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        """The reply as the trained sub-model on the exact slice sent (:meth:`_from_wire`), checked."""
        plan, target, low_rank = payload.context
        if low_rank:  # factors: the server adds B @ A to its exact float32 target (raises on a bad key or shape)
            trained = full_state(densify(wire_state(reply, self.wire.aliases), self.wire.exact(target),
                                         *self.low_rank, self.window_rank), self.wire.aliases)
        else:
            trained = self._from_wire(wire_state(reply, self.wire.aliases), plan, target)  # a stray alias is dropped
        stage_update(target, self.config, trained, plan)  # raises on a bad key, shape or value
        return Update(payload, weight, state_norm(wire_state(trained, self.wire.aliases)), trained)

    def _from_wire(self, reply: State, plan: SlicePlan, target: State) -> State:
        """A reply as the averager takes it: the client's change from what it received, added to the exact float32
        slice (:meth:`fedfusion.wire.quantize.Wire.update`), so neither a lossy downlink nor a quantised uplink's
        rounding of the weights themselves loses any part of the update; tied aliases restored."""
        if not self.wire.formats.lossless:
            reply = self.wire.formats.update(reply, self.wire.exact(extract(target, self.config, plan)))
        return full_state(reply, self.wire.aliases)  # aliases are rebuilt from what they alias

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        averager = SelectiveAverager(target, self.config, self.aggregate, self.trim)
        for update in updates:
            averager.add(update.data, plan=update.payload.context[0], weight=update.weight)
        coverage = averager.coverage()
        return Fold(fold(averager, self.outer), coverage)

    def secure_layout(self, payload: Payload) -> State:
        """Where ``payload``'s trained arrays sit in the target, for its client to pad its change to the target's
        shape under secure aggregation (:mod:`fedfusion.wire.secagg`): each array's target tensor and indices, its
        scaler, and the target's shapes (its tensors without tied aliases, sorted by name)."""
        plan, target, low_rank = payload.context
        if low_rank:
            raise ValueError("secure aggregation sums dense changes; a window_rank reply is factors")
        names = sorted(self.wire.exact(target))
        ids = {name: i for i, name in enumerate(names)}
        index, scales = {}, {}
        for name, sl in tensor_slices(target, self.config, plan).items():
            if name in ids:  # a tied alias is rebuilt from what it aliases
                index[sl.sub_name], scales[sl.sub_name] = (ids[name], sl.index), sl.scale
        return {secagg.INDEX_KEY: pack_index(index),
                secagg.SCALES_KEY: torch.tensor([scales[k] for k in sorted(scales)], dtype=torch.float64),
                secagg.SHAPES_KEY: secagg.pack_shapes([tuple(target[n].shape) for n in names])}

    def secure_support(self, target: State, payloads: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """Per target tensor (:meth:`secure_names`), the coordinates some payload of ``payloads`` trains (bool)."""
        held = {name: torch.zeros(target[name].shape, dtype=torch.bool) for name in self.secure_names(target)}
        for payload in payloads:
            for name, sl in tensor_slices(target, self.config, payload.context[0]).items():
                if name in held:
                    shape = sliced_shape(target[name].shape, sl.index)
                    scatter(held[name], sl.index, torch.ones(shape, dtype=torch.bool), accumulate=False)
        return held

    def secure_names(self, target: State) -> list[str]:
        """The target tensors of a securely aggregated vector, in its order (:meth:`secure_layout`'s)."""
        return sorted(self.wire.exact(target))

    def fold_sum(self, server_round: int, target: State, updates: Sequence[Update], total: State) -> Fold:
        """Fold a round whose replies are one sum: ``updates`` (data None) say who trained which slice at what
        weight, ``total`` is the unmasked sum of their weighted changes in the target's shape
        (:meth:`secure_names`). Each client's starting slice is known here, so the selective average comes out as
        :meth:`fold` makes it of the clients' trained slices."""
        averager = SelectiveAverager(target, self.config, self.aggregate, self.trim)
        for update in updates:
            plan, sent, _ = update.payload.context
            averager.add(full_state(self.wire.exact(extract(sent, self.config, plan)), self.wire.aliases), plan=plan,
                         weight=update.weight)
        averager.add_sum(full_state(total, self.wire.aliases))
        coverage = averager.coverage()
        return Fold(fold(averager, self.outer), coverage)

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        # the target is scored, not its int8/int4 copy: float16 at most
        fmt = "float32" if self.wire.formats.down == "float32" else "float16"
        return encode(self.wire.exact(target), fmt), merge(RoleSpec(self.role), ModelSpec(self.config.to_dict()))

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is not None:
            if "outer" not in state:
                raise ValueError("the checkpoint holds no outer-optimizer state but fusion.outer is set: resuming "
                                 "would restart its momentum; resume with the recipe the run was started with")
            self.outer.load_state_dict(state["outer"])
