"""Recipes: the typed schema of an experiment, loading, overrides and validation.

A recipe is a YAML file checked against the dataclasses below (OmegaConf structured configs), so an
unknown key or a wrong type fails at load time with the key's full name; value checks
(allowed choices, ranges, cross-section consistency) follow in :func:`validate`. The package imports nothing of
fedfusion's implementation: checks that need one (the device catalog, the selector's options, the files a recipe
names, the partitioner, an installed tracker) are :func:`fedfusion.run.check.check_recipe`'s, which a run calls
before it writes anything or imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from difflib import get_close_matches
from functools import lru_cache
from importlib import resources
from itertools import takewhile
from pathlib import Path
from typing import Any, Optional, TypedDict, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedfusion.config import methods
from fedfusion.config.choices import (
    AXES,
    BUILTIN_DATASETS,
    CHOICES,
    DEFAULT_CLOUD,
    DEFAULT_SERVER_DEVICE,
    FAMILY_MODEL_TYPES,
    FAMILY_TOKENIZERS,
    LORA_SECURE_METHODS,
    MIXABLE,
    SMOLLM2_BASE,
)
from fedfusion.config.methods import DISTILL, GENERATIVE, LORA, MIXED, SLICES, SUBMODEL, UNITS


class RecipeError(ValueError):
    """A recipe (file, override or value) is invalid; the message names the key."""


@dataclass
class DataConfig:
    """Where client text comes from and how it is split."""

    # shakespeare: one per (play, speaker) | text: a local file | facts: private facts (fedfusion.data.facts) | chatterbot (lora)
    # | dataset: a Hugging Face dataset split by a flwr-datasets partitioner (fedfusion.data.federated)
    source: str = "shakespeare"
    path: Optional[str] = None  # local .txt/.jsonl file when source=text; the training records when source=facts
    probes: Optional[str] = None  # source=facts: the probes file (jsonl: prompt, answer, client)
    # source=facts without path: synthetic biographies generated from the recipe seed (fedfusion.data.facts)
    people: int = 400
    facts_per_round: float = 40.0  # rounds: 0 gives one round per this many facts (probes), so more facts train longer
    skew: float = 1.0  # Zipf exponent of how many people each client owns (0: equal shares)
    # source=facts with model.pretrained: characters of general text (Shakespeare, which the base already models)
    # the target is also scored on every round, as general_loss (nats/token): what fine-tuning makes it forget. 0: none
    general_chars: int = 0
    min_chars: int = 2000  # a Shakespeare role needs this much text to become a client
    held_out: float = 0.1  # tail fraction of each client's text kept for evaluation
    eval_chars: int = 40000  # cap on the pooled held-out text the server evaluates on
    split: str = "category"  # chatterbot: category (one topic per client, non-IID) | iid
    language: str = "english"  # chatterbot corpus language
    # source=dataset: a hub id, local .jsonl/.json/.csv/.parquet/.txt file(s) (a path or glob), or shakespeare | chatterbot
    dataset: Optional[str] = None
    subset: Optional[str] = None  # hub dataset configuration
    dataset_split: str = "train"  # hub dataset split
    text_column: str = "text"  # language-model text
    prompt_column: str = "prompt"  # instruction pairs (fusion.method=lora)
    response_column: str = "response"
    label_column: Optional[str] = None  # whose skew plan and report show (default: the partitioner's `by`)
    shuffle: bool = True  # seeded shuffle before partitioning; false keeps file order (iid then cuts contiguous shards)
    # flwr-datasets partitioner and its parameters (fedfusion.data.partitioners): iid | dirichlet | shard | pathological | natural
    partitioner: dict[str, Any] = field(default_factory=lambda: {"name": "iid"})


@dataclass
class ModelConfig:
    """The target model: a Llama-architecture causal LM built from this config, or a pretrained one."""

    pretrained: Optional[str] = None  # local path or hub id; overrides the sizes below
    family: str = "llama"  # llama | mistral | qwen2 | gpt2 | opt: the architecture built from the sizes below
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 8
    intermediate_size: int = 512
    max_position: int = 512


@dataclass
class PopulationConfig:
    """The virtual clients: how many, and which device tier each one is."""

    num_clients: int = 32
    mix: dict[str, float] = field(
        default_factory=lambda: {"phone": 0.5, "laptop": 0.3, "desktop": 0.2}
    )
    catalog: Optional[str] = None  # a user device catalog (YAML) replacing the built-in one


@dataclass
class FusionConfig:
    """How client work is folded into the target."""

    method: str = SUBMODEL
    # static (HeteroFL prefix) | rolling (FedRolex window) | random (Federated Dropout) | ordered (FjORD)
    policy: str = "rolling"
    # heads | neurons | hidden | depth; None = the family's default (llama: heads, neurons)
    axes: Optional[list[str]] = None
    scaler: bool = True  # fold HeteroFL's scaler into the sliced weights (the sub-model estimates the full sums)
    # ordered: the widths a client samples from (<= its own); None = the values of fusion.widths
    ordered_ladder: Optional[list[float]] = None
    ordered_distill: bool = False  # ordered: self-distillation from the client's widest pass (FjORD's KD)
    widths: dict[str, float] = field(
        default_factory=lambda: {"phone": 0.125, "laptop": 0.25, "desktop": 0.5}
    )
    auto_widths: bool = False  # widths := the widest of width_ladder whose training fits each tier's memory
    width_ladder: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25, 0.125, 0.0625])
    stride: float = 0.125  # rolling: fraction of each axis the window advances per round
    stagger: bool = True  # rolling: each client's window starts where the previous one's ended
    weighting: str = "uniform"  # uniform (FedRolex) | examples (weight by num-examples)
    aggregate: str = "mean"  # mean | median | trimmed_mean (coordinate-wise, over the clients that held it)
    trim: float = 0.2  # trimmed_mean: fraction of values dropped at each end
    max_norm_ratio: float = 10.0  # reject a reply whose L2 norm exceeds this multiple of what was sent (0: off)
    # submodel / lora, how payloads travel down: float32 | float16 | int8 | int4 (blockwise absmax, fedfusion.wire.quantize);
    # the server folds each reply's change from what it sent onto the exact float32 target
    wire_dtype: str = "float32"
    wire_up: str = "float32"  # how replies travel up: float32 | int8 | int4 (the change from what was received)
    error_feedback: bool = True  # a quantised uplink carries over what its rounding left out to the next upload
    # submodel: a server step on each round's aggregated change (fedfusion.fusion.outer): none | avgm | nesterov | adam
    outer: str = "none"
    outer_lr: float = 1.0
    outer_momentum: float = 0.9  # avgm / nesterov momentum; adam's beta1
    # submodel: slice (a client runs its slice as a small model) | full (a client holds the whole target, frozen
    # in frozen_dtype, and trains its slice's coordinates with the exact gradient of the target's loss)
    forward: str = "slice"
    frozen_dtype: str = "int8"  # full: how the frozen target travels and sits on the device (float32 | float16 | int8 | int4)
    window_shared: bool = False  # full: the window also trains the tensors on no sliced axis (embeddings, norms)
    window_widths: dict[str, float] = field(default_factory=dict)  # full: a tier's window (fraction of units); default its width
    # full: r >= 1 trains a rank-r update of every matrix (fedfusion.models.low_rank) instead of a window of units; 0: off
    window_rank: int = 0
    window_core: bool = False  # full: every window also trains the smallest width's units (the small model's)
    # window_core: where the core trains. full: in the target's forward pass, with the window; small: in the small
    # model's own forward pass (exactly smallest-only's steps), the rest of the window learning what the target adds
    core_forward: str = "full"
    # window_core: draw each round's window from the units outside the core, so core + window has one size for the
    # whole run (a device program's fixed shape); false: the window rolls over every unit and its union with the core
    # shrinks where they overlap. No effect without window_core, nor with policy owned (its windows tile the rest)
    window_outside_core: bool = False
    # submodel: rounds 1..grow_round train the smallest width's static slice of a target silenced around it (the
    # target equals that small model: smallest-only training); later rounds train the whole grown target.
    # generative: the same grow rounds, then each device's own model starts from its slice of the grown target and
    # the server trains the grown target on the samples. 0: off. A round number, or a fraction in (0, 1) of the
    # run's rounds (0.33: the first third), so that `rounds=N` shortens a recipe without a second override; a
    # fraction resolves to round(fraction x rounds), at least 1, once rounds is known (grow_round_at)
    grow_round: Union[int, float] = 0
    # method=mixed: each tier's method (submodel | distill | generative); a method's per-tier settings stay in its
    # own section (a submodel or generative tier's width in fusion.widths, a distill tier's family in
    # distill.tier_family). Every round folds them into one target in fedfusion.fusion.rounds.FOLD_ORDER.
    tiers: dict[str, str] = field(default_factory=dict)

    def grow_rounds(self) -> int:
        """``grow_round`` as a round number; a fraction must have been resolved (loading does it once ``rounds`` is
        known), so a caller never reads a fraction as round 0."""
        if isinstance(self.grow_round, float):
            raise RecipeError(f"fusion.grow_round: the fraction {self.grow_round} is unresolved until rounds is known "
                              "(rounds=0: fedfusion.run.check.check_recipe sets it)")
        return self.grow_round


@dataclass
class FamilyConfig:
    """A small model family that some tiers train in distillation fusion."""

    model_type: str = "llama"  # llama | gpt2
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # llama: default num_heads
    intermediate_size: Optional[int] = None  # default 4 x hidden_size
    tokenizer: str = "target"  # target (the target's) | char | bpe (trained on the transfer text)
    bpe_vocab: int = 512


@dataclass
class TransferConfig:
    """The server's unlabeled transfer set, disjoint from every client's data."""

    source: str = "shakespeare"  # shakespeare: roles no client owns | text: a local file (e.g. the KJV)
    path: Optional[str] = None
    max_chars: int = 100000


@dataclass
class DistillConfig:
    """Distillation fusion (fusion.method=distill): small families per tier, distilled into the target."""

    families: dict[str, FamilyConfig] = field(default_factory=lambda: {
        "tiny": FamilyConfig(), "small": FamilyConfig(hidden_size=48, model_type="gpt2", tokenizer="bpe",
                                                      bpe_vocab=384)})
    tier_family: dict[str, str] = field(default_factory=lambda: {"phone": "tiny", "laptop": "small",
                                                                  "desktop": "small"})
    teacher: str = "fedet"  # feddf (average) | fedet (confidence-weighted consensus + diversity)
    average: str = "logits"  # feddf: logits | probs
    confidence: str = "variance"  # fedet: variance | entropy | maxprob
    diversity_weight: float = 0.1  # fedet
    temperature: float = 1.0
    kd_weight: float = 0.1  # 1: pure distillation (FedDF); lower mixes in the LM loss on the transfer text
    server_steps: int = 100
    server_lr: float = 1e-3
    server_batch_size: int = 16
    back_distill: bool = True  # the target teaches each family back (FedMKT)
    back_steps: int = 10
    back_lr: float = 1e-3
    server_device: str = DEFAULT_SERVER_DEVICE  # the catalog tier that prices the server's distillation work
    transfer: TransferConfig = field(default_factory=TransferConfig)


@dataclass
class GenerativeSection:
    """Generative distillation (fusion.method=generative): each tier keeps its own model (the static slice of
    the target at its fusion.widths), the target learns from the text those models write."""

    sample_fraction: float = 0.5  # windows a sampled client writes per window of its own data
    temperature: float = 1.0
    server_steps: int = 30  # target training steps per round on every client's latest samples
    server_lr: float = 3e-3
    server_batch: int = 64
    server_device: str = DEFAULT_SERVER_DEVICE  # the catalog tier that prices the server's training
    # > 0: each sampled position also carries its k likeliest tokens and log-probs (the target fits that teacher
    # distribution instead of the one sampled token); 0: token ids only
    top_k: int = 0
    # node: each device keeps its own model in its node's Flower context.state (a round's messages carry no model
    # once a device has one); server: the server holds every device's model and sends it both ways every round
    device_state: str = "node"


@dataclass
class LoRAConfig:
    """Heterogeneous-rank LoRA (fusion.method=lora): adapters of each tier's rank on one frozen base."""

    base: str = SMOLLM2_BASE  # smollm2 (offline GGUF package) | a local model directory | a .gguf file | a hub id
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    ranks: dict[str, int] = field(default_factory=lambda: {"phone": 4, "laptop": 8, "desktop": 32})
    alpha: float = 16.0
    quantize: dict[str, int] = field(default_factory=lambda: {"phone": 4, "laptop": 8, "desktop": 0})  # base bits
    dtype: str = "float32"  # unquantised base: float32 | bfloat16 | float16
    dropout: float = 0.0
    method: str = "flexlora"  # fedavg (equal ranks) | zeropad | hetlora | flexlora | flora
    eval_pairs: int = 200  # held-out pairs the server scores the target on
    samples: int = 3  # generations shown in the report


@dataclass
class SelectionConfig:
    """Which clients train in a round."""

    method: str = "random"  # random | oort | energy | carbon_budget (fedfusion.selection.selectors)
    options: dict[str, Any] = field(default_factory=dict)  # the selector's knobs, e.g. {alpha: 2.0}
    clients_per_round: int = 6
    min_clients: int = 1  # a round with fewer successful replies leaves the target unchanged
    evaluate_clients: int = 0  # clients that also score the target on their held-out text each round
    timeout_s: float = 600.0  # per-round deadline for replies
    overselect: float = 0.0  # sample (1 + overselect) x clients_per_round; the round closes at clients_per_round updates
    pool: int = 1000  # nodes a round draws from: all up to this many, else a random pool of them (queried once each)


@dataclass
class AvailabilitySection:
    """When virtual devices may train (diurnal windows, battery, network; fedfusion.devices.availability)."""

    enabled: bool = False  # off: every client is always available and never drops out
    start_clock_s: float = 0.0  # simulated time of round 1, seconds after midnight UTC of day 0
    round_interval_s: float = 600.0  # simulated time between round starts (longer if the slowest client is)
    deadline_s: float = 0.0  # virtual round deadline: a client predicted slower drops out (0: none)
    model: dict[str, float] = field(default_factory=dict)  # AvailabilityConfig knobs, e.g. {wifi_prob: 0.8}


@dataclass
class TrainConfig:
    """Local training on each client."""

    local_steps: int = 40
    lr: float = 3e-3
    batch_size: int = 16
    seq_len: int = 64
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # adamw | sgd (pair sgd with a server-side fusion.outer=adam: FedAdam)
    # recompute each layer's activations in backward (activation checkpointing): a width slice or full-forward
    # window keeps one layer's activations instead of every layer's, for a slower step (1.3-2.5x measured; torch clients)
    checkpoint: bool = False
    # the clients' lr over rounds (fedfusion.fusion.rounds.round_lr): constant | cosine | linear, from train.lr in
    # round 1 down to lr_final x train.lr in the last round
    lr_schedule: str = "constant"
    lr_final: float = 0.1
    # the most passes a client makes over its own training examples in a round: a client holding fewer than
    # local_steps x batch_size / max_epochs examples takes ceil(max_epochs x examples / batch_size) steps instead
    # of local_steps (fedfusion.fusion.rounds.client_steps), so a small client does not fit its own few examples
    # for many epochs and pull its slice of the target after them (client drift); 0: off, every client takes local_steps
    max_epochs: float = 0.0
    # rounds between central evaluations of the target (the server scoring it on the pooled held-out text), as
    # units.eval_every counts steps: round 0 and the last round are always scored, between them the rounds it divides
    # (1: every round; 0: none between). An unscored round's metrics.jsonl row has no eval_* fields; the report's best
    # is the best scored round. Not the units mode's (units.eval_every)
    eval_every: int = 1


@dataclass
class FaultConfig:
    """Injected client faults, for testing and benchmarking robustness (all off by default)."""

    crash_prob: float = 0.0  # a sampled client raises instead of training
    straggler_prob: float = 0.0  # a sampled client sleeps straggler_delay_s before replying
    straggler_delay_s: float = 0.0
    corrupt_prob: float = 0.0  # a sampled client replies with NaN in its update


@dataclass
class PrivacyConfig:
    """Client-side differential privacy: on each client's update by Flower's own mods (clip, local), or in the
    devices' training loop (dp_sgd: :mod:`fedfusion.train.dp`, accounted across every round a client trains)."""

    # none | clip (fixedclipping_mod: bound the update's L2 norm) | local (LocalDpMod: + noise) | dp_sgd (per-example
    # clipping and Gaussian noise in every local step, epsilon accounted over the run)
    mode: str = "none"
    clipping_norm: float = 1.0  # L2 bound on a client's update (clip, local) or on one example's gradient (dp_sgd)
    epsilon: float = 10.0  # local: per-round budget of one client's update; dp_sgd: a client's budget for the run
    delta: float = 1e-5  # local, dp_sgd
    # dp_sgd: the noise's sd over the clipping norm; 0: each client's, calibrated to spend epsilon over the rounds it
    # is expected to train (rounds x clients_per_round / clients)
    noise_multiplier: float = 1.0
    # the server folds the sum of the round's masked updates and never one client's (fedfusion.wire.secagg);
    # submodel tiers, aggregate mean, a float32 uplink, at least 2 clients a round
    secure_aggregation: bool = False


@dataclass
class EngineConfig:
    """Flower simulation engine resources."""

    cpus_per_client: float = 1.0
    threads_per_client: int = 1  # torch threads inside each client actor
    # torch threads for the server's own work (fold, distillation, central evaluation); 0: all of torch's, when
    # measurably faster than one right now, else one (re-measured each round: a busy core stalls every thread);
    # the count can change the last bits of the server's float sums: fix it for bit-for-bit reruns
    server_threads: int = 0
    # an existing Ray cluster to run the virtual clients on ("auto", or the head's "host:port" as `ray start --head`
    # prints it); empty: Flower starts a private one-machine Ray instance
    ray_address: str = ""


@dataclass
class OutputConfig:
    """Where and what the run writes."""

    dir: str = "runs"
    save_model: bool = True
    # LoRA: also write the base with the update merged in to model/ (a full copy of the base: 540 MB for SmolLM2-135M);
    # adapter/ (the update alone) is always written
    save_merged: bool = False
    checkpoint_every: int = 1  # rounds between checkpoints (0: none); `fedfusion run --resume RUN_DIR` continues
    # none | tensorboard (<run>/tensorboard) | mlflow (MLFLOW_TRACKING_URI): every metrics.jsonl row also goes there
    tracker: str = "none"


@dataclass
class ReportConfig:
    """What the run's report.md compares it with."""

    cloud: str = DEFAULT_CLOUD  # the catalog's cloud tier that the edge-vs-cloud section prices the same work on


class UnitsRuntime(TypedDict, total=False):
    """The devices' runtime as ``fedfusion.units.timeline.simulate`` takes it (keyword arguments)."""

    lanes: int
    supernodes: int


@dataclass
class UnitsSection:
    """The exact mode (fusion.method=units: the devices compute sub-matrix units of every step): the server keeps
    the target, the data and the optimizer and trains the target centrally; every linear layer's GEMMs
    (fedfusion.units) are cut into tiles that the population's nodes compute. ``train.lr``,
    ``train.weight_decay``, ``train.batch_size`` and ``train.seq_len`` set the central training;
    ``rounds``, ``selection``, ``train.lr_schedule`` and ``train.max_epochs`` do not apply."""

    offload: str = "mlp"  # mlp (the MLP's linear layers) | all (every linear layer, lm_head included)
    steps: int = 3  # optimizer steps on the pooled training text
    # each step's batch is cut into this many micro-batches (gradients summed); 0: the count the timeline predicts
    # keeps the busiest link >= 70 % busy without a slower step (fedfusion.units.timeline.choose_micro_batches)
    micro_batches: int = 1
    # micro-batches in flight at once (0: all): each runs in its own thread, so a device's next message is already
    # queued at the SuperLink while it computes the current one (the server's time between phases is hidden)
    in_flight: int = 0
    # each device sums its weight-gradient tiles over the step's micro-batches and uploads them once per step
    # (fedfusion.units.accumulate) instead of once per micro-batch; false: every micro-batch uploads its own
    accumulate: bool = True
    # messages a device holds at once, for the step's virtual time and the micro-batch choice (timeline.simulate):
    # 1 is the order of Flower's SuperNode (it pulls a message, computes, replies, then pulls the next: its links and
    # processor never overlap; its polling waits are not modelled); 0: no limit, a device runtime that receives its
    # next message while it computes (the seed paper's devices; 2 come within 5 % of it, units_microbatches.md)
    lanes: int = 1
    # SuperNodes per device (>= 1): micro-batch c runs on the device's node c mod k, so a device works on k messages
    # at once, each node with its own weight cache and running sums (weights travel and sums upload k times a step);
    # the simulation starts num_clients x k nodes, `fedfusion deploy` k SuperNodes per client. Needs lanes 1 and at
    # least k micro-batches (micro_batches: 0 then chooses among counts >= k).
    supernodes: int = 1
    deadline_factor: float = 3.0  # a device's deadline: this multiple of its message's predicted (virtual) time
    # the wall-clock floor of a device's deadline: the predicted times are the catalog device's, the real transport
    # (Flower's simulation engine sweeps each node's queue every 0.1 s) adds its own latency
    deadline_floor_s: float = 2.0
    verify: bool = True  # Freivalds' check on every product (a wrong tile is re-computed elsewhere)
    # the catalog tier that prices the server's own compute, its checks and its traffic (fedfusion.units.ledger)
    server_device: str = DEFAULT_SERVER_DEVICE
    eval_every: int = 0  # steps between central evaluations (0: only before the first and after the last step)
    # fault injection for tests and benchmarks: the device (client index) of this partition stops answering: each of
    # its nodes answers stall_after messages, then sleeps stall_s before every reply; -1: off. In simulation a
    # sleeping node holds one of the engine's actors (engine.cpus_per_client): other nodes queue when actors run out
    stall_partition: int = -1
    stall_after: int = 0
    stall_s: float = 0.0

    def runtime(self) -> UnitsRuntime:
        """The device runtime as ``fedfusion.units.timeline.simulate`` takes it: ``lanes``, or ``supernodes``."""
        return {"supernodes": self.supernodes} if self.supernodes > 1 else {"lanes": self.lanes}


@dataclass
class Recipe:
    """One experiment."""

    name: str = "quickstart"
    seed: int = 0
    # federated rounds; 0 with data.source=facts: as many as the facts need, ceil(facts / data.facts_per_round)
    # (resolved by fedfusion.run.check before anything is written; the run directory's recipe.yaml holds the number)
    rounds: int = 12
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    generative: GenerativeSection = field(default_factory=GenerativeSection)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    availability: AvailabilitySection = field(default_factory=AvailabilitySection)
    train: TrainConfig = field(default_factory=TrainConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    units: UnitsSection = field(default_factory=UnitsSection)

    def data_source(self) -> DataSource:
        """What rebuilds this recipe's client data in any process (:class:`DataSource`)."""
        return DataSource(self.data, self.population.num_clients, self.seed, self.model.pretrained)


@dataclass(frozen=True)
class DataSource:
    """What the population's data is derived from, and all of the recipe the data modules read: the data section,
    how many clients share it, the run's seed and the pretrained model whose tokenizer reads it (None: the fixed
    character tokenizer, or a facts dataset's word tokenizer)."""

    data: DataConfig
    num_clients: int
    seed: int
    tokenizer: Optional[str] = None


def builtin_recipe_path(name: str) -> Path:
    """Path of a recipe shipped with the package (e.g. ``quickstart``)."""
    return Path(str(resources.files("fedfusion.recipes").joinpath(f"{name}.yaml")))


def builtin_recipes() -> dict[str, str]:
    """Name -> description of every recipe shipped with the package: the file's opening comment, as one line."""
    found = {}
    for entry in sorted(resources.files("fedfusion.recipes").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            lines = entry.read_text(encoding="utf-8").splitlines()
            comment = [line.lstrip("#").strip() for line in takewhile(lambda x: x.startswith("#"), lines)]
            found[entry.name.removesuffix(".yaml")] = " ".join(comment)
    return found


def resolve_recipe_path(ref: str | Path) -> Path:
    """A recipe reference is a file path, or the bare name of a built-in recipe."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        inside = ", ".join(sorted(p.name for p in path.glob("*.y*ml"))) or "none"
        raise RecipeError(f"recipe {str(ref)!r}: a directory, not a recipe file; give one of its YAML files "
                          f"({inside}) or a built-in recipe name")
    if path.suffix == "" and builtin_recipe_path(str(ref)).is_file():
        return builtin_recipe_path(str(ref))
    names = list(builtin_recipes())
    close = get_close_matches(str(ref), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close and path.suffix == "" else ""
    raise RecipeError(f"recipe {str(ref)!r}: no such file and no built-in recipe of that name; {hint}"
                      f"built-in: {', '.join(names)}")


# Mappings a recipe states whole: given in a file (or as a whole override) they replace the default
# rather than merge into it, so ``mix: {phone: 1.0}`` means phones only.
WHOLE_MAPPINGS = ("data.partitioner", "population.mix", "fusion.widths", "fusion.tiers", "selection.options",
                  "availability.model", "distill.families", "distill.tier_family", "lora.ranks", "lora.quantize")


def _merge(base: DictConfig, cfg: Any, what: str, replace: tuple[str, ...]) -> DictConfig:
    try:
        if replace:  # merge() leaves its inputs alone; only the replacing updates below need a copy of the base
            base = base.copy()
        for key in replace:
            OmegaConf.update(base, key, {}, merge=False)
        merged = OmegaConf.merge(base, cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        raise RecipeError(f"{what}: bad key {key!r}: {msg}") from None
    if not isinstance(merged, DictConfig):  # a structured recipe merges into a mapping; say so if it did not
        raise RecipeError(f"{what}: not a mapping of recipe sections")
    return merged


def load_recipe(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file (or built-in name), apply ``key=value`` overrides, validate.

    Needs no torch, so a bad recipe is reported in about a second; :func:`fedfusion.run.check.check_recipe` adds
    the checks that need the implementation. ``fusion.auto_widths`` is resolved by
    :func:`fedfusion.run.planner.fit_widths`, which a run calls before it writes anything.
    """
    path = resolve_recipe_path(ref)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # unreadable or not UTF-8: OmegaConf.load below reports it as before
        text = None
    cfg = _merge_overrides(_file_config(path, text), overrides)  # not changed: _merge copies a base it changes
    recipe: Recipe = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(recipe)
    return recipe


@lru_cache(maxsize=32)
def _file_config(path: Path, text: str | None) -> DictConfig:
    """The recipe file at ``path`` merged into the schema, cached by the file's text (a test suite loads the same
    few recipes hundreds of times; the load and merge were ~0.4 s each). Callers never change it in place."""
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml errors come in several types
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    if not raw:  # not silently the defaults: a recipe states at least its name
        raise RecipeError(f"{path}: empty recipe; state at least its name (e.g. `name: my-run`) and what differs from "
                          "the defaults (recipes/rolling.yaml is the defaults plus an lr schedule and an epoch cap)")
    given = tuple(k for k in WHOLE_MAPPINGS if OmegaConf.select(raw, k, default=None) is not None)
    return _merge(_schema(), raw, str(path), given)


@lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The recipe's structured schema, built once (80 ms a time); merged from, never changed in place."""
    return OmegaConf.structured(Recipe)


def _whole_mapping_near(key: str) -> bool:
    """Whether ``key`` is, is inside, or contains one of :data:`WHOLE_MAPPINGS` (an override there replaces)."""
    return any(key == w or key.startswith(w + ".") or w.startswith(key + ".") for w in WHOLE_MAPPINGS)


def _merge_overrides(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """Apply ``key=value`` overrides in order. Overrides that replace no whole mapping are merged in one step (one
    merge costs ~20 ms, a recipe with a dozen overrides was 0.5 s of CPU); if that fails, or a whole mapping is
    involved, they are applied one by one, which names the override at fault."""
    keys = [item.split("=", 1)[0].strip() for item in overrides if "=" in item]
    nested = any(b.startswith(a + ".") for a in keys for b in keys)  # a section and a key inside it: in order
    if overrides and len(keys) == len(overrides) and not nested and not any(_whole_mapping_near(k) for k in keys):
        try:
            return _merge(cfg, OmegaConf.from_dotlist(list(overrides)), "overrides", ())
        except Exception:  # the one-by-one path below raises the precise error
            pass
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key = item.split("=", 1)[0].strip()
        try:
            dot = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise RecipeError(f"override {item!r}: {str(exc).splitlines()[0]}") from None
        cfg = _merge(cfg, dot, f"override {item!r}", (key,) if key in WHOLE_MAPPINGS else ())
    return cfg


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise RecipeError(f"{key}: must be > 0, got {value}")


def _check_ray_address(address: str) -> None:
    """``engine.ray_address``: empty, ``auto`` or ``host:port`` (a Ray Client ``ray://`` address is not one the
    simulation engine can drive: its actor pool runs in this process, which must join the cluster)."""
    host, _, port = address.rpartition(":")
    if address in ("", "auto") or (host and "/" not in host and port.isdigit() and 0 < int(port) < 65536):
        return
    raise RecipeError(f"engine.ray_address: {address!r} is not 'auto' or the head's host:port "
                      "(e.g. 127.0.0.1:6379, as `ray start --head` prints it)")


def validate(recipe: Recipe) -> None:
    """Value checks beyond types; raises RecipeError naming the first bad key."""
    for key, allowed in CHOICES.items():
        value: Any = recipe
        for part in key.split("."):
            value = getattr(value, part)
        if value not in allowed:
            raise RecipeError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    if recipe.rounds < 0 or (recipe.rounds == 0 and recipe.data.source != "facts"):
        raise RecipeError(f"rounds: must be > 0 (0, as many as the facts need, only with data.source=facts), "
                          f"got {recipe.rounds}")
    for key in (
        "data.facts_per_round", "population.num_clients", "selection.clients_per_round", "selection.min_clients",
        "selection.timeout_s", "train.local_steps", "train.lr", "train.batch_size", "train.seq_len",
        "engine.cpus_per_client", "engine.threads_per_client", "model.hidden_size", "model.num_layers",
        "model.num_heads", "model.num_kv_heads", "model.intermediate_size", "data.eval_chars",
    ):
        obj: Any = recipe
        for part in key.split("."):
            obj = getattr(obj, part)
        _positive(key, obj)
    if recipe.engine.server_threads < 0:
        raise RecipeError(f"engine.server_threads: must be >= 0 (0: chosen each round), got {recipe.engine.server_threads}")
    for name in ("crash_prob", "straggler_prob", "corrupt_prob"):
        if not 0 <= getattr(recipe.faults, name) <= 1:
            raise RecipeError(f"faults.{name}: must be in [0, 1], got {getattr(recipe.faults, name)}")
    if recipe.faults.straggler_delay_s < 0:
        raise RecipeError(f"faults.straggler_delay_s: must be >= 0, got {recipe.faults.straggler_delay_s}")
    if not 0 <= recipe.selection.overselect <= 4:
        raise RecipeError(f"selection.overselect: must be in [0, 4] (extra clients sampled per round, as a fraction "
                          f"of clients_per_round), got {recipe.selection.overselect}")
    if "seed" in recipe.selection.options:
        raise RecipeError("selection.options.seed: the selector is seeded by the recipe's seed")
    for name in ("start_clock_s", "round_interval_s", "deadline_s"):
        if getattr(recipe.availability, name) < 0:
            raise RecipeError(f"availability.{name}: must be >= 0, got {getattr(recipe.availability, name)}")
    _check_ray_address(recipe.engine.ray_address)
    if recipe.output.checkpoint_every < 0:
        raise RecipeError(f"output.checkpoint_every: must be >= 0, got {recipe.output.checkpoint_every}")
    if recipe.privacy.mode != "none":
        for name in ("clipping_norm", "epsilon", "delta"):
            _positive(f"privacy.{name}", getattr(recipe.privacy, name))
        if recipe.privacy.delta >= 1:
            raise RecipeError(f"privacy.delta: must be < 1, got {recipe.privacy.delta}")
        if recipe.privacy.mode == "dp_sgd":
            if recipe.privacy.noise_multiplier < 0:
                raise RecipeError(f"privacy.noise_multiplier: must be > 0, or 0 to calibrate each client's noise to "
                                  f"privacy.epsilon, got {recipe.privacy.noise_multiplier}")
        elif uses(recipe, GENERATIVE):
            raise RecipeError(f"privacy.mode: {recipe.privacy.mode} clips a reply against the model sent, but a "
                              "generative client replies samples; use privacy.mode=dp_sgd (its samples are drawn from a "
                              "DP-trained model)")
    if recipe.privacy.secure_aggregation:
        _validate_secure(recipe)
    if not 0 < recipe.data.held_out < 1:
        raise RecipeError(f"data.held_out: must be in (0, 1), got {recipe.data.held_out}")
    if recipe.data.source == "text" and not recipe.data.path:
        raise RecipeError("data.path: required when data.source is 'text'")
    if recipe.data.source == "dataset" and not recipe.data.dataset:
        raise RecipeError("data.dataset: required when data.source is 'dataset' (a hub id, local file(s), "
                          f"or one of {', '.join(BUILTIN_DATASETS)})")
    if recipe.data.source == "dataset" and recipe.fusion.method == DISTILL and recipe.distill.transfer.source == "shakespeare":
        raise RecipeError("distill.transfer.source: with data.source=dataset the transfer text is a file "
                          "(distill.transfer.source=text, distill.transfer.path=...)")
    if recipe.data.source == "facts":
        if bool(recipe.data.path) != bool(recipe.data.probes):
            raise RecipeError("data.probes: data.path and data.probes go together (your facts), or neither (generated)")
        if not recipe.data.path and recipe.data.people < recipe.population.num_clients:
            raise RecipeError(f"data.people: {recipe.data.people} people cannot give each of "
                              f"{recipe.population.num_clients} clients one")
        if recipe.data.skew < 0:
            raise RecipeError(f"data.skew: must be >= 0, got {recipe.data.skew}")
        if not set(tier_methods(recipe).values()) <= {SUBMODEL, GENERATIVE} and recipe.fusion.method != LORA:
            raise RecipeError(f"fusion.method: data.source=facts runs with submodel, generative or lora fusion, "
                              f"got {recipe.fusion.method!r}")
        if recipe.data.general_chars and not recipe.model.pretrained:
            raise RecipeError("data.general_chars: scores what a pretrained target forgets; set model.pretrained")
    if recipe.data.general_chars < 0 or (recipe.data.general_chars and recipe.data.source != "facts"):
        raise RecipeError(f"data.general_chars: >= 0, and only with data.source=facts, got {recipe.data.general_chars} "
                          f"with source {recipe.data.source!r}")
    m = recipe.model
    if m.hidden_size % m.num_heads:
        raise RecipeError(f"model.num_heads: {m.num_heads} does not divide hidden_size {m.hidden_size}")
    if m.num_heads % m.num_kv_heads:
        raise RecipeError(f"model.num_kv_heads: {m.num_kv_heads} does not divide num_heads {m.num_heads}")
    if recipe.train.seq_len > m.max_position:
        raise RecipeError(f"train.seq_len: {recipe.train.seq_len} exceeds model.max_position {m.max_position}")
    if not recipe.population.mix:
        raise RecipeError("population.mix: needs at least one tier")
    _validate_tiers(recipe)
    methods = tier_methods(recipe)
    for tier, share in recipe.population.mix.items():
        if share <= 0:
            raise RecipeError(f"population.mix.{tier}: share must be > 0, got {share}")
        if methods[tier] in SLICES and not recipe.fusion.auto_widths and tier not in recipe.fusion.widths:
            raise RecipeError(f"fusion.widths: no width for tier {tier!r} of population.mix")
    total = sum(recipe.population.mix.values())
    if abs(total - 1) > 1e-6:  # not normalised silently: a share that is off is more likely a typo than intended
        raise RecipeError(f"population.mix: the shares must sum to 1, got {total:g} "
                          f"({', '.join(f'{t}: {v:g}' for t, v in recipe.population.mix.items())})")
    if uses(recipe, DISTILL):
        _validate_distill(recipe)
    if (recipe.fusion.method == LORA) != (recipe.data.source == "chatterbot") and recipe.data.source not in ("dataset",
                                                                                                         "facts"):
        raise RecipeError(f"data.source: fusion.method=lora trains on instruction pairs (data.source=chatterbot or "
                          f"dataset) or on facts, and only it trains on chatterbot; got method {recipe.fusion.method!r} "
                          f"with source {recipe.data.source!r}")
    if recipe.fusion.method == LORA and recipe.data.source == "facts" and recipe.model.pretrained != recipe.lora.base:
        raise RecipeError(f"model.pretrained: fusion.method=lora on data.source=facts tokenises the facts with "
                          f"model.pretrained, so it must name lora.base ({recipe.lora.base!r}), got "
                          f"{recipe.model.pretrained!r}")
    if recipe.fusion.method == LORA:
        _validate_lora(recipe)
    if uses(recipe, GENERATIVE):
        g = recipe.generative
        for name in ("sample_fraction", "temperature", "server_lr"):
            _positive(f"generative.{name}", getattr(g, name))
        for name in ("server_steps", "server_batch"):
            if getattr(g, name) < 1:
                raise RecipeError(f"generative.{name}: must be >= 1, got {getattr(g, name)}")
        if g.top_k < 0:
            raise RecipeError(f"generative.top_k: must be >= 0 (0: the samples' token ids only), got {g.top_k}")
    for tier, width in recipe.fusion.widths.items():
        if not 0 < width <= 1:
            raise RecipeError(f"fusion.widths.{tier}: must be in (0, 1], got {width}")
    _validate_wire(recipe)
    _validate_growth(recipe)
    _validate_units(recipe)
    if recipe.fusion.max_norm_ratio < 0:
        raise RecipeError(f"fusion.max_norm_ratio: must be >= 0, got {recipe.fusion.max_norm_ratio}")
    if not recipe.fusion.width_ladder or not all(0 < w <= 1 for w in recipe.fusion.width_ladder):
        raise RecipeError(f"fusion.width_ladder: needs widths in (0, 1], got {recipe.fusion.width_ladder}")
    if not 0 <= recipe.fusion.trim < 0.5:
        raise RecipeError(f"fusion.trim: must be in [0, 0.5), got {recipe.fusion.trim}")
    _positive("fusion.outer_lr", recipe.fusion.outer_lr)
    if recipe.fusion.outer != "none" and not uses(recipe, SUBMODEL):
        raise RecipeError(f"fusion.outer: a server optimizer steps folded slices (fusion.method=submodel); "
                          f"{recipe.fusion.method!r} does not use it")
    if recipe.train.checkpoint and (recipe.fusion.method != SUBMODEL or recipe.fusion.policy == "ordered"):
        raise RecipeError("train.checkpoint: applies to width slices and full-forward windows (fusion.method=submodel, "
                          f"not policy ordered), got method {recipe.fusion.method!r}, policy {recipe.fusion.policy!r}")
    if recipe.train.optimizer != "adamw" and recipe.fusion.method == LORA:
        raise RecipeError("train.optimizer: LoRA clients train with AdamW; only 'adamw' applies to fusion.method=lora")
    if recipe.train.eval_every < 0:
        raise RecipeError(f"train.eval_every: must be >= 0 (rounds between central evaluations; 0: only round 0 and "
                          f"the last), got {recipe.train.eval_every}")
    if not 0 <= recipe.train.max_epochs < math.inf:
        raise RecipeError(f"train.max_epochs: must be a finite number >= 0 (passes over a client's examples per "
                          f"round; 0: off), got {recipe.train.max_epochs}")
    if not 0 < recipe.train.lr_final <= 1:
        raise RecipeError(f"train.lr_final: must be in (0, 1] (the last round's lr as a fraction of train.lr), "
                          f"got {recipe.train.lr_final}")
    if not 0 <= recipe.fusion.outer_momentum < 1:
        raise RecipeError(f"fusion.outer_momentum: must be in [0, 1), got {recipe.fusion.outer_momentum}")
    if not 0 < recipe.fusion.stride <= 1:
        raise RecipeError(f"fusion.stride: must be in (0, 1], got {recipe.fusion.stride}")
    axes = recipe.fusion.axes
    for axis in axes or ():
        if axis not in AXES:
            raise RecipeError(f"fusion.axes: {axis!r} is not one of {', '.join(AXES)}")
    if axes is not None and not axes:
        raise RecipeError("fusion.axes: name at least one axis, or leave it unset for the family's default")
    fused = recipe.model.family in ("gpt2", "opt") and not recipe.model.pretrained
    if axes and fused and (("heads" in axes) != ("hidden" in axes)):
        raise RecipeError(f"fusion.axes: a {recipe.model.family} model slices 'heads' and 'hidden' together "
                          "(head_dim = hidden / heads)")
    for width in recipe.fusion.ordered_ladder or ():
        if not 0 < width <= 1:
            raise RecipeError(f"fusion.ordered_ladder: widths must be in (0, 1], got {width}")
    if recipe.selection.min_clients > recipe.selection.clients_per_round:
        raise RecipeError(
            f"selection.min_clients: {recipe.selection.min_clients} exceeds clients_per_round "
            f"{recipe.selection.clients_per_round}"
        )
    if recipe.selection.clients_per_round > recipe.population.num_clients and recipe.fusion.method != UNITS:
        raise RecipeError(
            f"selection.clients_per_round: {recipe.selection.clients_per_round} exceeds "
            f"population.num_clients {recipe.population.num_clients}"
        )


def _validate_units(recipe: Recipe) -> None:
    """``units.*``: the exact mode trains one Llama target centrally on language-model text."""
    u = recipe.units
    for key in ("steps", "deadline_factor", "deadline_floor_s"):
        _positive(f"units.{key}", getattr(u, key))
    if u.micro_batches < 0:
        raise RecipeError(f"units.micro_batches: must be >= 0 (0: chosen before the run from the devices' links), "
                          f"got {u.micro_batches}")
    if u.eval_every < 0:
        raise RecipeError(f"units.eval_every: must be >= 0, got {u.eval_every}")
    if u.in_flight < 0:
        raise RecipeError(f"units.in_flight: must be >= 0 (0: every micro-batch), got {u.in_flight}")
    if u.lanes < 0:
        raise RecipeError(f"units.lanes: must be >= 0 (1: Flower's SuperNode, one message at a time; 0: no limit), "
                          f"got {u.lanes}")
    if u.supernodes < 1:
        raise RecipeError(f"units.supernodes: must be >= 1 (SuperNodes per device), got {u.supernodes}")
    if u.supernodes > 1 and u.lanes != 1:
        raise RecipeError(f"units.supernodes: {u.supernodes} SuperNodes per device hold one message each; "
                          f"units.lanes must be 1 with it, got {u.lanes}")
    if recipe.fusion.method != UNITS:
        return
    if u.supernodes > recipe.train.batch_size:
        raise RecipeError(f"units.supernodes: {u.supernodes} SuperNodes per device need as many micro-batches, more "
                          f"than train.batch_size {recipe.train.batch_size}")
    if u.micro_batches and u.supernodes > u.micro_batches:
        raise RecipeError(f"units.supernodes: micro-batch c runs on a device's node c mod {u.supernodes}, so with "
                          f"units.micro_batches {u.micro_batches} some of the {u.supernodes} would get no work; use at "
                          f"most {u.micro_batches}")
    if u.micro_batches and recipe.train.batch_size % u.micro_batches:
        raise RecipeError(f"units.micro_batches: {u.micro_batches} does not divide train.batch_size "
                          f"{recipe.train.batch_size}")
    if recipe.model.family != "llama":
        raise RecipeError(f"model.family: fusion.method=units routes a Llama's linear layers, got {recipe.model.family!r}")
    if recipe.data.source not in ("shakespeare", "text", "dataset"):
        raise RecipeError(f"data.source: fusion.method=units trains on language-model text (shakespeare, text or "
                          f"dataset), got {recipe.data.source!r}")
    if not -1 <= u.stall_partition < recipe.population.num_clients:
        raise RecipeError(f"units.stall_partition: -1 (off) or a partition below population.num_clients "
                          f"{recipe.population.num_clients}, got {u.stall_partition}")
    if u.stall_after < 0 or u.stall_s < 0:
        raise RecipeError(f"units.stall_after, units.stall_s: must be >= 0, got {u.stall_after}, {u.stall_s}")
    if recipe.privacy.mode != "none":
        raise RecipeError("privacy.mode: the units mode sends no model update to clip; leave it 'none'")


def grow_round_at(fraction: float, rounds: int) -> int:
    """The round a ``fusion.grow_round`` fraction of ``rounds`` names: round(fraction x rounds), at least 1."""
    return max(1, round(fraction * rounds))


def _validate_growth(recipe: Recipe) -> None:
    """Growth is width slicing's and generative distillation's (its grow rounds are smallest-only slicing);
    full-forward windows are width slicing's, and a window reaches its own coordinates only with the ordinary
    policies."""
    f = recipe.fusion
    given = f.grow_round
    if isinstance(given, float) and given.is_integer():  # 4.0 in YAML is round 4
        given = f.grow_round = int(given)
    if isinstance(given, float) and not 0 < given < 1:
        raise RecipeError(f"fusion.grow_round: a round number or a fraction in (0, 1) of the rounds, got {given}")
    if isinstance(given, float) and recipe.rounds:  # rounds 0: resolved once the facts set it (check_recipe)
        f.grow_round = grow_round_at(given, recipe.rounds)
    elif given < 0 or (recipe.rounds and given > recipe.rounds):
        raise RecipeError(f"fusion.grow_round: must be in [0, rounds={recipe.rounds}], got {given} (the "
                          "small model grows into the target after that round: run more rounds, give a fraction "
                          "of them (e.g. 0.33), or set fusion.grow_round to at most rounds; 0 grows nothing)")
    if f.grow_round and f.method not in (SUBMODEL, GENERATIVE):
        raise RecipeError(f"fusion.grow_round: applies to fusion.method=submodel or generative, got {f.method!r}")
    if f.forward == "full" and f.method != SUBMODEL:
        raise RecipeError(f"fusion.forward=full: applies to fusion.method=submodel, got {f.method!r}")
    if f.forward == "full" and f.policy == "ordered":
        raise RecipeError("fusion.forward=full: policy 'ordered' trains nested sub-models in their own forward pass; "
                          "use static, rolling, random or owned")
    if f.window_rank < 0 or (f.window_rank and f.forward != "full"):
        raise RecipeError(f"fusion.window_rank: a rank >= 1 trains low-rank updates with fusion.forward=full "
                          f"(0: off), got {f.window_rank} with forward={f.forward}")
    if f.window_rank and (f.wire_up != "float32" or f.window_widths):
        raise RecipeError("fusion.window_rank: low-rank updates reply their factors in float32 and cover every unit; "
                          "leave fusion.wire_up at float32 and fusion.window_widths unset")
    if f.window_core and (f.forward != "full" or f.window_rank):
        raise RecipeError("fusion.window_core: adds the smallest width's units to a window of units "
                          f"(fusion.forward=full, window_rank 0), got forward={f.forward}, window_rank={f.window_rank}")
    if f.core_forward == "small" and not (f.window_core and f.window_shared):
        raise RecipeError("fusion.core_forward=small: the core is the small model inside a window that holds it "
                          f"whole; set fusion.window_core=true and fusion.window_shared=true, got "
                          f"window_core={f.window_core}, window_shared={f.window_shared}")
    for tier, width in f.window_widths.items():
        if tier not in f.widths:
            raise RecipeError(f"fusion.window_widths.{tier}: not a tier of fusion.widths ({', '.join(f.widths)})")
        if not 0 < width <= 1:
            raise RecipeError(f"fusion.window_widths.{tier}: must be in (0, 1], got {width}")


def _validate_wire(recipe: Recipe) -> None:
    """The wire formats apply to the tiers whose replies are the model trained (sub-models, LoRA adapters), and a
    quantised message is not what Flower's DP mods can clip (they compare reply and payload value by value)."""
    f = recipe.fusion
    for key, value in (("wire_dtype", f.wire_dtype), ("wire_up", f.wire_up)):
        if value == "float32":
            continue
        if not (uses(recipe, SUBMODEL) or uses(recipe, LORA)):
            raise RecipeError(f"fusion.{key}: {value} applies to the tiers of fusion.method=submodel or lora only, "
                              f"got {f.method!r}")
        if recipe.privacy.mode in ("clip", "local") and value in ("int8", "int4"):
            raise RecipeError(f"fusion.{key}: {value} cannot go with privacy.mode={recipe.privacy.mode} (Flower's "
                              "DP mods clip the reply against the payload value by value); use float32 or float16 down "
                              "and float32 up")


def _validate_secure(recipe: Recipe) -> None:
    """Secure aggregation sums target-shaped changes: it needs a method that folds a sum (width slices and full
    windows; LoRA but hetlora), the plain mean, exact float32 replies (and for LoRA, whose start the server adds
    back, exact float32 payloads) and a round of at least two clients."""
    f, why = recipe.fusion, "privacy.secure_aggregation: the server folds one sum of masked updates, so"
    methods = set(tier_methods(recipe).values())
    if methods not in ({SUBMODEL}, {LORA}):
        raise RecipeError(f"{why} every tier must train fusion.method=submodel or every tier lora, got {f.method!r}")
    if methods == {LORA} and recipe.lora.method not in LORA_SECURE_METHODS:
        raise RecipeError(f"{why} lora.method must be one of {', '.join(LORA_SECURE_METHODS)} (hetlora weighs each "
                          f"client by its own update's norm), got {recipe.lora.method!r}")
    if methods == {LORA} and f.wire_dtype != "float32":
        raise RecipeError(f"{why} fusion.wire_dtype must be float32 with LoRA (the server adds back the exact adapter "
                          "it sent)")
    if f.aggregate != "mean":
        raise RecipeError(f"{why} fusion.aggregate must be mean (a {f.aggregate} needs each client's values)")
    if f.window_rank:
        raise RecipeError(f"{why} fusion.window_rank must be 0 (a low-rank reply is factors, not a change)")
    if f.wire_up != "float32":
        raise RecipeError(f"{why} fusion.wire_up must be float32 (the masked vector is its own fixed-point encoding)")
    if recipe.selection.clients_per_round < 2:
        raise RecipeError(f"{why} selection.clients_per_round must be >= 2, got {recipe.selection.clients_per_round}")


def tier_methods(recipe: Recipe) -> dict[str, str]:
    """The fusion method of every tier of the population: ``fusion.tiers`` for ``fusion.method=mixed``, otherwise
    ``fusion.method`` for each."""
    if recipe.fusion.method == MIXED:
        return {tier: recipe.fusion.tiers.get(tier, "") for tier in recipe.population.mix}
    return {tier: recipe.fusion.method for tier in recipe.population.mix}


def method_label(recipe: Recipe) -> str:
    """The fusion method as a run's header and plan name it (the slicing policy where its entry says so; a mixed
    federation's method per tier)."""
    f = recipe.fusion
    if f.method == MIXED:
        return f"{MIXED}(" + ", ".join(f"{tier}={method}" for tier, method in tier_methods(recipe).items()) + ")"
    return f"{f.method}/{f.policy}" if methods.method(f.method).policy_in_label else f.method


def nodes_per_client(recipe: Recipe) -> int:
    """SuperNodes each client of the population runs (``units.supernodes`` in the units mode, else 1): node
    ``partition-id`` p is client ``p // k``'s node ``p % k`` (the simulation and ``fedfusion deploy`` start
    ``num_clients x k`` nodes)."""
    return recipe.units.supernodes if recipe.fusion.method == UNITS else 1


def uses(recipe: Recipe, method: str) -> bool:
    """Whether some tier of the recipe's population trains with ``method``."""
    return method in tier_methods(recipe).values()


def _validate_tiers(recipe: Recipe) -> None:
    """``fusion.tiers``: given exactly for fusion.method=mixed, one known, mixable method for every tier of the mix."""
    f = recipe.fusion
    if f.method != MIXED:
        if f.tiers:
            raise RecipeError(f"fusion.tiers: per-tier methods need fusion.method=mixed, got {f.method!r}")
        return
    for tier in recipe.population.mix:
        if tier not in f.tiers:
            raise RecipeError(f"fusion.tiers: no method for tier {tier!r} of population.mix")
    for tier, method in f.tiers.items():
        if tier not in recipe.population.mix:
            raise RecipeError(f"fusion.tiers.{tier}: not a tier of population.mix ({', '.join(recipe.population.mix)})")
        if method == LORA:
            raise RecipeError(f"fusion.tiers.{tier}: lora cannot be mixed: its target is a frozen pretrained base plus "
                              f"one adapter update, the others train the whole target; use one of {', '.join(MIXABLE)}")
        if method not in MIXABLE:
            raise RecipeError(f"fusion.tiers.{tier}: {method!r} is not one of {', '.join(MIXABLE)}")


def _validate_distill(recipe: Recipe) -> None:
    d = recipe.distill
    for tier, method in tier_methods(recipe).items():
        if method == DISTILL and tier not in d.tier_family:
            raise RecipeError(f"distill.tier_family: no family for tier {tier!r} of population.mix")
    for tier, family in d.tier_family.items():
        if family not in d.families:
            raise RecipeError(f"distill.tier_family.{tier}: unknown family {family!r}; "
                              f"families: {', '.join(sorted(d.families))}")
    for name, f in d.families.items():
        if f.model_type not in FAMILY_MODEL_TYPES:
            raise RecipeError(f"distill.families.{name}.model_type: {f.model_type!r} is not one of "
                              f"{', '.join(FAMILY_MODEL_TYPES)}")
        if f.tokenizer not in FAMILY_TOKENIZERS:
            raise RecipeError(f"distill.families.{name}.tokenizer: {f.tokenizer!r} is not one of {', '.join(FAMILY_TOKENIZERS)}")
        for key in ("hidden_size", "num_layers", "num_heads"):
            _positive(f"distill.families.{name}.{key}", getattr(f, key))
        if f.hidden_size % f.num_heads:
            raise RecipeError(f"distill.families.{name}.num_heads: {f.num_heads} does not divide hidden_size "
                              f"{f.hidden_size}")
        if f.tokenizer == "bpe" and f.bpe_vocab < 260:
            raise RecipeError(f"distill.families.{name}.bpe_vocab: must be >= 260 (bytes + specials), got {f.bpe_vocab}")
    for key in ("temperature", "server_steps", "server_lr", "server_batch_size", "back_steps", "back_lr"):
        _positive(f"distill.{key}", getattr(d, key))
    if not 0 <= d.kd_weight <= 1:
        raise RecipeError(f"distill.kd_weight: must be in [0, 1], got {d.kd_weight}")
    if d.diversity_weight < 0:
        raise RecipeError(f"distill.diversity_weight: must be >= 0, got {d.diversity_weight}")
    if d.transfer.source == "text" and not d.transfer.path:
        raise RecipeError("distill.transfer.path: required when distill.transfer.source is 'text'")
    _positive("distill.transfer.max_chars", d.transfer.max_chars)


def _validate_lora(recipe: Recipe) -> None:
    lora = recipe.lora
    for tier in recipe.population.mix:
        if tier not in lora.ranks:
            raise RecipeError(f"lora.ranks: no rank for tier {tier!r} of population.mix")
    for tier, rank in lora.ranks.items():
        _positive(f"lora.ranks.{tier}", rank)
    for tier, bits in lora.quantize.items():
        if bits not in (0, 4, 8):
            raise RecipeError(f"lora.quantize.{tier}: must be 0 (none), 4 or 8 bits, got {bits}")
    if not lora.target_modules:
        raise RecipeError("lora.target_modules: name at least one module (e.g. q_proj)")
    if lora.method == "fedavg" and len({lora.ranks[t] for t in recipe.population.mix}) > 1:
        raise RecipeError("lora.method: fedavg needs one rank for every tier; use zeropad, hetlora, flexlora or flora")
    for key in ("alpha", "eval_pairs"):
        _positive(f"lora.{key}", getattr(lora, key))
    if not 0 <= lora.dropout < 1:
        raise RecipeError(f"lora.dropout: must be in [0, 1), got {lora.dropout}")


def to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (re-loading it reproduces the run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))
