"""The exact (units) mode's plan: one step's phases priced by the timeline on the population's devices, the
server's own work, and the micro-batch count a run uses; each takes the recipe sections it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedfusion.config.methods import UNITS
from fedfusion.config.sections import (
    DataSource,
    ModelConfig,
    PopulationConfig,
    ReportConfig,
    TrainConfig,
    UnitsSection,
)
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.memory import param_count
from fedfusion.fusion.plan import PlanView, recipe_target


def units_view(name: str, units: UnitsSection, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               report: ReportConfig, source: DataSource) -> PlanView:
    """The units mode: per device tier and step what it moves and how long it is busy, the server's row and the
    same step on the cloud GPU, and the step's time."""
    step, rows = units_plan(units, train, population, model, report, source)
    s = step["server"]
    micro = step["micro_batches"]
    notes = (f"one step: {micro} micro-batch{'es' if micro > 1 else ''}, {step['phases']} phases, "
             f"{step['step_s']:.2f} virtual s, {step['step_over_bound']:.2f}x its lower bound "
             f"{step['lower_bound_s']:.2f} s ({step['bound_by']}), busiest-link utilisation "
             f"{step['link_utilisation']:.2f}, {step['MB down']:.1f} MB down and {step['MB up']:.1f} MB up in all; "
             f"{step['steps']} steps (fedfusion.units.timeline on the catalog's links, no churn, the server's links "
             f"and compute queued, {_runtime_words(units)})",
             f"server links ({s['server_device']}, units.server_device): send {step['server_send_gbps']:.3g} Gb/s, "
             f"receive {step['server_recv_gbps']:.3g} Gb/s, busier link {step['server_link_utilisation']:.2f} busy "
             f"over the step; compute {step['server_tflops']:.3g} TFLOP/s",
             f"server ({s['server_device']}) per step: own compute {s['server_flops'] / 1e9:.3g} GFLOP (attention "
             f"{s['server_attention_flops'] / 1e9:.3g}, element-wise {s['server_elementwise_flops'] / 1e9:.3g}, linear "
             f"{s['server_linear_flops'] / 1e9:.3g}, optimizer {s['server_optimizer_flops'] / 1e9:.3g}) "
             f"{s['server_compute_s']:.3g} s; checks {s['server_verify_flops'] / 1e9:.3g} GFLOP "
             f"{s['server_verify_s']:.3g} s; egress {s['server_egress_bytes'] / 1e6:.1f} MB, ingress "
             f"{s['server_ingress_bytes'] / 1e6:.1f} MB {s['server_comm_s']:.3g} s; {s['server_energy_j']:.3g} J "
             f"(price_work on the catalog tier)",
             f"the same step on {s['cloud_device']}: {s['cloud_flops'] / 1e9:.3g} GFLOP in "
             f"{s['cloud_step_s']:.3g} s, {s['cloud_energy_j']:.3g} J; the units step takes "
             f"{step['step_s'] / s['cloud_step_s']:.0f}x as long")
    return PlanView(f"plan for {name} ({UNITS}, offload={units.offload}: per device and step; the "
                    f"target trains on the server)", rows,
                    ("tier", "devices", "used", "units/step", "largest unit", "MB down", "MB up", "busy s"),
                    left=("tier", "largest unit"), width=140, notes=notes, per_round=False)


def _runtime_words(u: UnitsSection) -> str:
    """How the plan's step line names the devices' runtime (``units.lanes``, ``units.supernodes``)."""
    if u.supernodes > 1:
        return f"devices running {u.supernodes} SuperNodes of one message each: units.supernodes"
    held = f"{u.lanes or 'any number of'} message{'' if u.lanes == 1 else 's'}"
    return f"devices holding {held} at a time: units.lanes"


def units_plan(units: UnitsSection, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               report: ReportConfig, source: DataSource) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The exact (units) mode's step from the recipe's shape alone (``fedfusion.units.phases`` priced by the
    timeline on the population's devices, no churn, the server's own time between phases): the micro-batch count
    (:func:`units_micro_batches`), the step's virtual seconds, its lower bound (and what sets it), the busiest link's
    and the server's links' utilisation, the server's link rates and compute rate, the phases, the
    server's work and the same step on the cloud GPU
    (:func:`fedfusion.units.ledger.price_server`, under ``server``), and per tier the devices, their mean units per
    step, the largest unit (rows x columns x inner length), their mean MB down / up and busy seconds per step."""
    from fedfusion.data.population import tier_list
    from fedfusion.units.devices import server_from_catalog
    from fedfusion.units.ledger import price_server
    from fedfusion.units.plan import CostModel, Tile, plan_phase
    from fedfusion.units.timeline import simulate

    micro = units_micro_batches(units, train, population, model, source)
    work = units_work(units, train, population, model, source, micro)
    phases, own, verify = work.phases, work.own, work.verify
    gemms = [g for shapes, _ in phases for g in shapes] * micro
    catalog = population_catalog(population)
    server = catalog[units.server_device]
    tiers = tier_list(population, source.seed)
    devices = units_devices(units, population, source.seed)
    timing = simulate(devices, [phases] * micro, deadline_factor=units.deadline_factor, server_gap_s=work.gap_s,
                      optimizer_s=work.optimizer_s, in_flight=units.in_flight, accumulate=units.accumulate,
                      server=server_from_catalog(server), **units.runtime())
    priced = price_server(server, catalog[report.cloud], own, verify, int(timing.down_bytes.sum()),
                          int(timing.up_bytes.sum()), float(sum(g.flops for g in gemms)))
    cm = CostModel(devices)
    held: list[list[Tile]] = [[] for _ in devices]  # the timeline's plans (no churn): each device's units
    for shapes, _ in phases:
        for tile in plan_phase(cm, list(range(len(devices))), shapes).tiles:
            held[tile.device].append(tile)
    rows = []
    for tier in sorted(set(tiers)):
        idx = [i for i, t in enumerate(tiers) if t == tier]
        busy = [max(timing.down_busy_s[i], timing.up_busy_s[i], timing.compute_s[i]) for i in idx]
        mine = [t for i in idx for t in held[i]]
        big = max(mine, key=lambda t: t.flops, default=None)
        rows.append({"tier": tier, "devices": len(idx), "used": int(sum(timing.down_bytes[i] > 0 for i in idx)),
                     "units/step": len(mine) * micro / len(idx),
                     "largest unit": f"{big.i1 - big.i0}x{big.j1 - big.j0}x{big.k1 - big.k0}" if big else "",
                     "MB down": float(sum(timing.down_bytes[i] for i in idx)) / len(idx) / 1e6,
                     "MB up": float(sum(timing.up_bytes[i] for i in idx)) / len(idx) / 1e6,
                     "busy s": sum(busy) / len(busy)})
    s = priced.row()
    rows += [{"tier": f"server ({server.name})", "devices": 1, "used": 1, "units/step": None, "largest unit": "",
              "MB down": priced.ingress_bytes / 1e6,
              "MB up": priced.egress_bytes / 1e6,
              "busy s": float(s["server_compute_s"]) + float(s["server_verify_s"]) + float(s["server_comm_s"])},
             {"tier": f"{priced.cloud} (the same step)", "devices": 1, "used": 1, "units/step": None, "largest unit": "",
              "MB down": 0.0, "MB up": 0.0,
              "busy s": priced.cloud_step.compute_s}]
    step = {"step_s": timing.step_s, "lower_bound_s": timing.lower_bound_s, "bound_by": timing.bound_by,
            "step_over_bound": timing.step_over_bound, "link_utilisation": timing.link_utilisation,
            "server_link_utilisation": timing.server_link_utilisation, "server_send_gbps": server.up_mbps / 1e3,
            "server_recv_gbps": server.down_mbps / 1e3, "server_tflops": server.tflops,
            "phases": len(phases) * micro, "micro_batches": micro,
            "steps": units.steps, "MB down": float(timing.down_bytes.sum()) / 1e6, "MB up": float(timing.up_bytes.sum()) / 1e6,
            "server": s}
    return step, rows


@dataclass(frozen=True)
class UnitsWork:
    """One units-mode step of a recipe's shape at a micro-batch count: one micro-batch's phases, the server's own
    FLOPs and its checks' FLOPs, and the server's seconds between phases and for the optimizer (priced on
    ``units.server_device``)."""

    phases: list[Any]
    own: dict[str, float]  # the server's own FLOPs by kind (fedfusion.units.phases.server_flops)
    verify: float
    gap_s: float
    optimizer_s: float


def units_work(units: UnitsSection, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               source: DataSource, micro_batches: int) -> UnitsWork:
    """The step :func:`units_plan` prices, with the batch cut into ``micro_batches``."""
    from fedfusion.data.population import data_spec, data_tokenizer
    from fedfusion.units.ledger import server_timeline
    from fedfusion.units.phases import WEIGHT_GRADIENT, llama_phases, server_flops
    from fedfusion.units.verify import check_flops

    m, seq = model, train.seq_len
    vocab = len(data_tokenizer(data_spec(source)))
    tokens = train.batch_size // micro_batches * seq
    shape: dict[str, Any] = dict(hidden=m.hidden_size, intermediate=m.intermediate_size, layers=m.num_layers,
                                 heads=m.num_heads, kv_heads=m.num_kv_heads, vocab=vocab)
    phases = llama_phases(**shape, tokens=tokens, mode=units.offload)
    own = server_flops(**shape, tokens=tokens * micro_batches, seq=seq, params=param_count(recipe_target(m, source)),
                       mode=units.offload, optimizer=train.optimizer)
    # one check per product; a weight gradient summed on the devices is checked once per step and SuperNode, over
    # the tokens of that node's micro-batches (fedfusion.units.accumulate; node j sums micro-batches j, j+K, ..)
    summed = units.accumulate and micro_batches > 1
    per_node = [c for c in (len(range(j, micro_batches, units.supernodes)) for j in range(units.supernodes)) if c]
    verify = 0.0
    for shapes, specs in phases if units.verify else ():
        for g, spec in zip(shapes, specs):
            if summed and spec == WEIGHT_GRADIENT:
                verify += sum(check_flops(g.m, g.n, g.k * c) for c in per_node)
            else:
                verify += micro_batches * check_flops(g.m, g.n, g.k)
    server = population_catalog(population)[units.server_device]
    gap_s, optimizer_s = server_timeline(server, own, verify, len(phases) * micro_batches)
    return UnitsWork(phases, own, verify, gap_s, optimizer_s)


def units_devices(units: UnitsSection, population: PopulationConfig, seed: int) -> list[Any]:
    """The units mode's devices, one per client of the population, its tiers drawn with the run's ``seed``
    (:func:`fedfusion.units.from_catalog`, link rates times ``units.link_scale``)."""
    from fedfusion.data.population import tier_list
    from fedfusion.units import from_catalog

    catalog = population_catalog(population)
    return [from_catalog(catalog[t], name=str(i), link_scale=units.link_scale)
            for i, t in enumerate(tier_list(population, seed))]


def units_micro_batches(units: UnitsSection, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
                        source: DataSource) -> int:
    """``units.micro_batches`` as a run uses it: the recipe's count, or with 0 the count
    :func:`fedfusion.units.timeline.choose_micro_batches` predicts for the recipe's devices and shape (the smallest
    that keeps the busiest link >= 70 % busy without a slower step, else the fastest)."""
    from fedfusion.units.devices import server_from_catalog
    from fedfusion.units.timeline import choose_micro_batches

    if units.micro_batches:
        return units.micro_batches
    works = {}  # count -> its work, built once for both callbacks

    def work(m: int) -> UnitsWork:
        if m not in works:
            works[m] = units_work(units, train, population, model, source, m)
        return works[m]

    chosen, _ = choose_micro_batches(
        units_devices(units, population, source.seed), lambda m: work(m).phases, train.batch_size,
        kwargs_for=lambda m: {"server_gap_s": work(m).gap_s, "optimizer_s": work(m).optimizer_s},
        deadline_factor=units.deadline_factor, in_flight=units.in_flight, accumulate=units.accumulate, min_count=units.supernodes,
        server=server_from_catalog(population_catalog(population)[units.server_device]), **units.runtime())
    return chosen
