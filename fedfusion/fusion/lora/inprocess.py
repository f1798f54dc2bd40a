"""Heterogeneous-rank LoRA on the in-process driver (:func:`fedfusion.fusion.inprocess.run_rounds`): the same
:class:`~fedfusion.fusion.lora.method.LoRAMethod` as a Flower run, each client training its adapter as the client
role does (:func:`fedfusion.train.adapter.train_adapter`), on one frozen base held in memory; for benchmarks and
tests."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from fedfusion.fusion import inprocess
from fedfusion.fusion.base import Payload, State
from fedfusion.fusion.inprocess import Evaluate, Rounds, RunStats
from fedfusion.fusion.lora.aggregate import merged_arrays
from fedfusion.fusion.lora.method import LoRAMethod, adapted_modules, split_global
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec
from fedfusion.models.adapters import merged_update
from fedfusion.train.adapter import AdapterSetting, train_adapter
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.quantize import decode

IN_MEMORY = "in-memory"  # the base spec's name for a base the loop holds itself (no client loads it)


@dataclass(frozen=True, kw_only=True)
class LoRARun(Rounds):
    """One LoRA federation: the frozen ``base`` (unquantised, held once), each partition's training windows and
    device tier, each tier's rank, one alpha, the base modules adapted and the aggregation (``lora.method``)."""

    base: PreTrainedModel
    windows: Sequence[torch.Tensor]  # per partition
    tiers: Sequence[str]  # per partition
    ranks: Mapping[str, int]
    alpha: float = 16.0
    modules: tuple[str, ...] = ("q_proj", "v_proj")
    method: str = "flexlora"
    dropout: float = 0.0


def run_lora(run: LoRARun, evaluate: Evaluate | None = None) -> tuple[State, RunStats]:
    """``run.rounds`` rounds of :class:`~fedfusion.fusion.lora.method.LoRAMethod` through the driver from no update;
    returns the global update (``m.lora_A``/``m.lora_B`` pairs, :func:`with_update` applies it) and the costs."""
    run.on_cpu("run_lora")
    tiers = sorted(set(run.tiers))
    method = LoRAMethod(adapted_modules(run.base, list(run.modules)), ranks={t: run.ranks[t] for t in tiers},
                        alphas=dict.fromkeys(tiers, run.alpha), quantize=dict.fromkeys(tiers, 0), method=run.method,
                        base_params=sum(p.numel() for p in run.base.parameters()),
                        base=LoRABaseSpec(IN_MEMORY, "float32", run.modules, run.dropout))

    def train(rnd: int, payload: Payload) -> tuple[State, dict[str, float]]:
        spec, p = AdapterSpec.from_config(payload.spec), payload.client.partition
        setting = AdapterSetting(spec.rank, spec.alpha, run.modules, run.dropout)
        factors, out = train_adapter(run.base, decode(payload.arrays), run.windows[p], setting, payload.client.seed,
                                     steps=run.steps_for(len(run.windows[p])), lr=run.lr_at(rnd) * payload.lr_scale,
                                     batch_size=run.batch_size, weight_decay=run.weight_decay,
                                     dp=run.private(len(run.windows[p]), len(run.windows)))
        return factors, {**out.metrics(), NUM_EXAMPLES: len(run.windows[p])}

    # by its module name, as the other loops call it (benchmarks/privacy.py wraps it to read the replies)
    return inprocess.run_rounds(dict.fromkeys(tiers, method), list(run.tiers), {}, train, run, evaluate)


@contextmanager
def with_update(base: PreTrainedModel, update: State) -> Iterator[PreTrainedModel]:
    """``base`` with the global update ``update`` (the method's target: ``m.lora_A``/``m.lora_B`` pairs, or none)
    added to its adapted modules while inside, as the server's evaluation applies it."""
    with merged_update(base, merged_arrays(*split_global(update)) if update else {}):
        yield base
