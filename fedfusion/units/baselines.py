"""Baselines for the units mode on the same devices and links: a pipeline + data-parallel schedule in the manner of
DTFM (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous Environments", NeurIPS 2022), and
one cloud GPU.

What the pipeline model prices. The decoder layers are split into ``S`` contiguous stages, each on one device; ``D``
replicas of that pipeline each train ``batch / D`` sequences, in ``M`` micro-batches, GPipe's order (every
micro-batch's forward, then every backward). Stage ``j`` holds its layers' weights, gradients and AdamW moments in
float32 (16 bytes per parameter), the first stage the embedding too and the last the ``lm_head`` (tied weights
counted twice); a micro-batch's activations (``t x hidden`` float32 values, as the units mode's wire) go from
stage ``j`` to ``j + 1`` over ``j``'s uplink and ``j + 1``'s downlink, their gradients back the other way. Per
micro-batch stage ``j`` computes ``f_j`` forward and ``b_j = 2 f_j`` backward (``3 f_j`` with activation
checkpointing, which recomputes the forward), and a transfer takes ``c = overhead + bytes / min(up, down) + rtt / 2``
(the link busy for all but the ``rtt / 2``). Each pass through the pipeline takes

    sum_j f_j + sum_j c_j + (M - 1) * max(max_j f_j, max_j (c_j - rtt / 2))

(GPipe's fill and drain: the first micro-batch crosses every stage, the others follow at the pace of the busiest
resource), forward and backward alike. Then each stage's ``D`` holders all-reduce its gradient over a ring on
their own links, ``2 (D - 1) / D x 4 P_j`` bytes each way and ``2 (D - 1)`` messages of ``overhead + rtt / 2``,
and step AdamW on their own processor (``OPTIMIZER_FLOPS["adamw"]`` per parameter): the step adds the slowest
stage's sync and update. A stage's memory is its parameters' 16 bytes each plus the activations its layers keep
(``fedfusion.devices.memory.layer_activation_values``) for the ``M`` micro-batches in flight (with checkpointing
only each layer's input per micro-batch and one layer's activations), and the last stage's logits and their
log-softmax (float32; every micro-batch's, one with checkpointing): it must fit the device's ``memory_bytes``, or
the plan says no pipeline fits.

:func:`plan_pipeline` searches the stage count, the replicas, the micro-batch size and checkpointing over a fleet
(the ``S x D`` fastest devices, stage ``j`` on the ``D`` next fastest, the stage priced on the slowest of them; the
layers allotted so the stages' compute is balanced within each device's memory) and keeps the fastest step.

What it leaves out: DTFM's scheduler (its genetic search over which device pairs exchange what: here the devices
are ranked by speed only), 1F1B and interleaved schedules, overlapping the gradient sync with the backward, the
attention's and norms' memory beyond the activation count above, embedding FLOPs, the loss's softmax FLOPs, the
input tokens' and labels' transfer, NAT traversal (devices reach each other directly at their own link rates; no
relay through a server) and stragglers.

:func:`gpu_step` is one cloud GPU: the step's FLOPs at the device's sustained rate, and whether the whole training
state (``fedfusion.devices.memory.estimate_memory``) fits its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import LlamaConfig

from fedfusion.devices.memory import estimate_memory, layer_activation_values
from fedfusion.units.devices import UnitDevice
from fedfusion.units.phases import OPTIMIZER_FLOPS

FLOAT_BYTES = 4  # float32 activations and gradients, as the units mode's wire
STATE_BYTES = 16  # per trained parameter: float32 weight, gradient and AdamW's two moments


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (a Llama's, or with ``gated=False`` an OPT-style MLP)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    gated: bool = True

    @property
    def layer_params(self) -> int:
        """One decoder layer's linear weights (biases and norms left out)."""
        kv = self.kv_heads * (self.hidden // self.heads)
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        return self.hidden * (2 * self.hidden + 2 * kv) + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Decoder layers, embedding and ``lm_head`` (untied)."""
        return self.layers * self.layer_params + 2 * self.embedding_params

    def layer_forward_flops(self, tokens: int, seq: int) -> float:
        """One layer's forward over ``tokens`` tokens in windows of ``seq``: its GEMMs and the attention cores."""
        return 2.0 * tokens * self.layer_params + 4.0 * tokens * seq * self.hidden

    def head_forward_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.embedding_params

    def step_flops(self, tokens: int, seq: int) -> float:
        """A training step: forward and backward (3x the forward) of every layer and ``lm_head``, and AdamW."""
        forward = self.layers * self.layer_forward_flops(tokens, seq) + self.head_forward_flops(tokens)
        return 3.0 * forward + OPTIMIZER_FLOPS["adamw"] * self.params

    def config(self) -> LlamaConfig:
        """A Llama config of this shape for the memory estimate of one GPU (an ungated MLP as a gated one of the
        same parameters)."""
        inter = self.intermediate if self.gated else 2 * self.intermediate // 3
        return LlamaConfig(hidden_size=self.hidden, intermediate_size=inter, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab)


@dataclass(frozen=True)
class PipelineCost:
    """One pipeline + data-parallel step: the schedule, its time by part, each stage's memory, and per stage
    position what each of its ``replicas`` devices computes and moves (for pricing energy)."""

    stages: int
    replicas: int
    micro_batches: int  # per replica
    micro_tokens: int
    checkpoint: bool
    layers: tuple[int, ...]  # per stage
    devices: tuple[UnitDevice, ...]  # per stage: the device it is priced on
    forward_s: float
    backward_s: float
    sync_s: float  # the slowest stage's gradient all-reduce and optimizer step
    memory_bytes: tuple[float, ...]  # per stage
    flops: tuple[float, ...]  # per stage, each of its devices
    bytes_down: tuple[float, ...]
    bytes_up: tuple[float, ...]
    holders: tuple[tuple[UnitDevice, ...], ...] = ()  # per stage its ``replicas`` devices (plan_pipeline's)

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.sync_s

    @property
    def fits(self) -> bool:
        """Every stage's memory fits its device."""
        return all(m <= d.memory_bytes for m, d in zip(self.memory_bytes, self.devices))

    @property
    def devices_used(self) -> int:
        return self.stages * self.replicas


def _transfer(src: UnitDevice, dst: UnitDevice, nbytes: float) -> tuple[float, float]:
    """(time, link occupancy) of one message from ``src`` to ``dst``."""
    busy = src.overhead_s + nbytes / min(src.up_bps, dst.down_bps)
    return busy + max(src.rtt_s, dst.rtt_s) / 2, busy


def _pass(compute: list[float], transfers: list[tuple[float, float]], micro_batches: int) -> float:
    """GPipe's fill and drain: the first micro-batch through every stage and link, the others at the busiest
    resource's pace."""
    pace = max(compute + [busy for _, busy in transfers])
    return sum(compute) + sum(t for t, _ in transfers) + (micro_batches - 1) * pace


def stage_memory(shape: ModelShape, layers: int, first: bool, last: bool, micro_tokens: int, seq: int,
                 micro_batches: int, checkpoint: bool) -> float:
    """Bytes a stage of ``layers`` layers holds at its peak (the module's docstring)."""
    params = layers * shape.layer_params + (first + last) * shape.embedding_params
    layer = layer_activation_values(micro_tokens, seq, shape.hidden, shape.intermediate, shape.heads)
    if checkpoint:
        acts = micro_batches * layers * micro_tokens * shape.hidden + (layer if layers else 0)
    else:
        acts = micro_batches * layers * layer
    logits = last * (1 if checkpoint else micro_batches) * 2 * micro_tokens * shape.vocab
    return float(STATE_BYTES * params + FLOAT_BYTES * (acts + logits))


def pipeline_cost(shape: ModelShape, devices: list[UnitDevice], layers: list[int], *, micro_batches: int,
                  micro_tokens: int, seq: int, replicas: int = 1, checkpoint: bool = False) -> PipelineCost:
    """The step of one pipeline over ``devices`` (stage ``j`` on ``devices[j]`` with ``layers[j]`` layers) and its
    ``replicas`` copies, ``micro_batches`` micro-batches of ``micro_tokens`` tokens each per replica."""
    if len(devices) != len(layers) or not devices or min(layers) < 0 or sum(layers) != shape.layers:
        raise ValueError(f"{len(devices)} stages with layers {layers}: every stage needs >= 0 layers, "
                         f"{shape.layers} in all")
    if micro_batches < 1 or replicas < 1:
        raise ValueError(f"micro_batches and replicas must be >= 1, got {micro_batches} and {replicas}")
    s = len(devices)
    fwd_flops = [n * shape.layer_forward_flops(micro_tokens, seq) + (j == s - 1) * shape.head_forward_flops(
        micro_tokens) for j, n in enumerate(layers)]
    fwd = [f / d.flops for f, d in zip(fwd_flops, devices)]
    bwd = [(3 if checkpoint else 2) * f for f in fwd]
    act = FLOAT_BYTES * micro_tokens * shape.hidden
    ahead = [_transfer(devices[j], devices[j + 1], act) for j in range(s - 1)]
    back = [_transfer(devices[j + 1], devices[j], act) for j in range(s - 1)]
    params = [n * shape.layer_params + (j == 0) * shape.embedding_params + (j == s - 1) * shape.embedding_params
              for j, n in enumerate(layers)]
    ring = [2 * (replicas - 1) / replicas * FLOAT_BYTES * p for p in params]
    sync = [(r / min(d.up_bps, d.down_bps) + 2 * (replicas - 1) * (d.overhead_s + d.rtt_s / 2))
            + OPTIMIZER_FLOPS["adamw"] * p / d.flops for r, p, d in zip(ring, params, devices)]
    inner = [act * micro_batches * ((j > 0) + (j < s - 1)) for j in range(s)]  # activations in, gradients in
    return PipelineCost(
        stages=s, replicas=replicas, micro_batches=micro_batches, micro_tokens=micro_tokens, checkpoint=checkpoint,
        layers=tuple(layers), devices=tuple(devices), forward_s=_pass(fwd, ahead, micro_batches),
        backward_s=_pass(bwd, back, micro_batches), sync_s=max(sync),
        memory_bytes=tuple(stage_memory(shape, n, j == 0, j == s - 1, micro_tokens, seq, micro_batches, checkpoint)
                           for j, n in enumerate(layers)),
        flops=tuple(micro_batches * (4 if checkpoint else 3) * f + OPTIMIZER_FLOPS["adamw"] * p
                    for f, p in zip(fwd_flops, params)),
        bytes_down=tuple(i + r for i, r in zip(inner, ring)), bytes_up=tuple(i + r for i, r in zip(inner, ring)))


def allot_layers(shape: ModelShape, devices: list[UnitDevice], *, micro_batches: int, micro_tokens: int, seq: int,
                 checkpoint: bool) -> list[int] | None:
    """Layers per stage that balance the stages' compute, each stage at least one layer and within its device's
    memory; None when no allotment fits."""
    s = len(devices)
    if s > shape.layers:
        return None
    per_layer = shape.layer_forward_flops(micro_tokens, seq)
    caps = []
    for j, d in enumerate(devices):
        fixed = stage_memory(shape, 0, j == 0, j == s - 1, micro_tokens, seq, micro_batches, checkpoint)
        one = stage_memory(shape, 1, j == 0, j == s - 1, micro_tokens, seq, micro_batches, checkpoint) - fixed
        caps.append(int(min(shape.layers, max(0.0, (d.memory_bytes - fixed) // one))))
    if min(caps) < 1 or sum(caps) < shape.layers:
        return None
    head = [(j == s - 1) * shape.head_forward_flops(micro_tokens) for j in range(s)]

    def take(t: float) -> list[int]:  # the layers each stage computes within t seconds of forward
        return [max(1, min(cap, int((t * d.flops - h) // per_layer))) for cap, d, h in zip(caps, devices, head)]

    lo, hi = 0.0, max((shape.layers * per_layer + h) / d.flops for d, h in zip(devices, head))
    for _ in range(64):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if sum(take(mid)) >= shape.layers else (mid, hi)
    layers = take(hi)
    excess = sum(layers) - shape.layers
    for j in sorted(range(s), key=lambda j: -(layers[j] * per_layer + head[j]) / devices[j].flops):
        cut = min(excess, layers[j] - 1)
        layers[j] -= cut
        excess -= cut
    return layers


def _worst(holders: list[UnitDevice]) -> UnitDevice:
    """The device a stage is priced on: the slowest, smallest and farthest of its holders in every respect."""
    return replace(holders[0], name="/".join(sorted({d.name for d in holders})),
                   memory_bytes=min(d.memory_bytes for d in holders), flops=min(d.flops for d in holders),
                   down_bps=min(d.down_bps for d in holders), up_bps=min(d.up_bps for d in holders),
                   rtt_s=max(d.rtt_s for d in holders), overhead_s=max(d.overhead_s for d in holders))


def plan_pipeline(shape: ModelShape, fleet: list[UnitDevice], *, batch: int, seq: int) -> PipelineCost | None:
    """The fastest pipeline + data-parallel step of ``batch`` sequences of ``seq`` tokens on ``fleet`` (the module's
    docstring): every stage count, replica count (a divisor of ``batch``), micro-batch size (a divisor of a replica's
    sequences) and checkpointing; None when no stage count fits the devices' memory."""
    ranked = sorted(fleet, key=lambda d: -d.flops)
    best: PipelineCost | None = None
    for replicas in (r for r in range(1, batch + 1) if batch % r == 0):
        per = batch // replicas
        for stages in range(1, min(shape.layers, len(fleet) // replicas) + 1):
            devices = [_worst(list(ranked[j * replicas:(j + 1) * replicas])) for j in range(stages)]
            holders = tuple(tuple(ranked[j * replicas:(j + 1) * replicas]) for j in range(stages))
            for size in (b for b in range(1, per + 1) if per % b == 0):
                for checkpoint in (False, True):
                    micro, tokens = per // size, size * seq
                    layers = allot_layers(shape, devices, micro_batches=micro, micro_tokens=tokens, seq=seq,
                                          checkpoint=checkpoint)
                    if layers is None:
                        continue
                    cost = pipeline_cost(shape, devices, layers, micro_batches=micro, micro_tokens=tokens, seq=seq,
                                         replicas=replicas, checkpoint=checkpoint)
                    if best is None or cost.step_s < best.step_s:
                        best = replace(cost, holders=holders)
    return best


def min_stage_bytes(shape: ModelShape, seq: int) -> float:
    """The least memory any stage needs: one layer, one sequence per micro-batch, checkpointed."""
    return stage_memory(shape, 1, False, False, seq, seq, 1, True)


@dataclass(frozen=True)
class GpuStep:
    """One step on one GPU: seconds at its sustained rate, the training state it needs and whether that fits."""

    name: str
    step_s: float
    needs_bytes: float
    memory_bytes: float

    @property
    def fits(self) -> bool:
        return self.needs_bytes <= self.memory_bytes


def gpu_step(shape: ModelShape, name: str, flops_rate: float, memory_bytes: float, *, batch: int, seq: int,
             step_flops: float | None = None) -> GpuStep:
    """The step (``step_flops``, default :meth:`ModelShape.step_flops`) at ``flops_rate`` FLOP/s; the memory of
    float32 AdamW training with activation checkpointing (``estimate_memory``), the least a whole step needs."""
    flops = shape.step_flops(batch * seq, seq) if step_flops is None else step_flops
    needs = estimate_memory(shape.config(), batch, seq, checkpoint=True).total
    return GpuStep(name, flops / flops_rate, float(needs), memory_bytes)

