"""The recipe's sections: one dataclass per section (OmegaConf structured configs, a field's comment saying what it
means), each checking its own fields in ``check`` beside them; :class:`fedfusion.config.recipe.Recipe` composes them
and holds the few rules that read several sections. Imports nothing of fedfusion's implementation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, TypedDict, Union

from fedfusion.config.choices import (
    AXES,
    BUILTIN_DATASETS,
    DEFAULT_CLOUD,
    DEFAULT_SERVER_DEVICE,
)
from fedfusion.config.methods import BY_NAME, GROWS, MIXED, SUBMODEL


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

    def check(self) -> None:
        """``data.*`` on its own: sizes and the files a source needs named (``general_chars``, which facts with a
        pretrained target score, is the recipe's rule)."""
        for key in ("facts_per_round", "eval_chars"):
            positive(f"data.{key}", getattr(self, key))
        if not 0 < self.held_out < 1:
            raise RecipeError(f"data.held_out: must be in (0, 1), got {self.held_out}")
        if self.source == "text" and not self.path:
            raise RecipeError("data.path: required when data.source is 'text'")
        if self.source == "dataset" and not self.dataset:
            raise RecipeError("data.dataset: required when data.source is 'dataset' (a hub id, local file(s), "
                              f"or one of {', '.join(BUILTIN_DATASETS)})")
        if self.source == "facts" and bool(self.path) != bool(self.probes):
            raise RecipeError("data.probes: data.path and data.probes go together (your facts), or neither (generated)")
        if self.source == "facts" and self.skew < 0:
            raise RecipeError(f"data.skew: must be >= 0, got {self.skew}")


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

    def check(self) -> None:
        """``model.*``: positive sizes, heads that divide the hidden size and key/value heads that divide heads."""
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            positive(f"model.{key}", getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise RecipeError(f"model.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise RecipeError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")


@dataclass
class PopulationConfig:
    """The virtual clients: how many, and which device tier each one is."""

    num_clients: int = 32
    mix: dict[str, float] = field(
        default_factory=lambda: {"phone": 0.5, "laptop": 0.3, "desktop": 0.2}
    )
    catalog: Optional[str] = None  # a user device catalog (YAML) replacing the built-in one
    # the tiers' memory as fitted and planned, times this: a small target emulating the larger one it stands for
    memory_scale: float = 1.0

    def check(self) -> None:
        """``population.*``: clients, a mix of positive shares that sum to 1, a memory scale in (0, 1]."""
        positive("population.num_clients", self.num_clients)
        scale = self.memory_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise RecipeError(f"population.memory_scale: must be in (0, 1] (1: the catalog's memory), got "
                              f"{self.memory_scale!r}")
        if not self.mix:
            raise RecipeError("population.mix: needs at least one tier")
        for tier, share in self.mix.items():
            if share <= 0:
                raise RecipeError(f"population.mix.{tier}: share must be > 0, got {share}")
        total = sum(self.mix.values())
        if abs(total - 1) > 1e-6:  # not normalised silently: a share that is off is more likely a typo than intended
            raise RecipeError(f"population.mix: the shares must sum to 1, got {total:g} "
                              f"({', '.join(f'{t}: {v:g}' for t, v in self.mix.items())})")


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
    # full: a window of a fraction f of the units trains at train.lr x f^-window_lr_power (0: the recipe's lr; 0.5:
    # lr/sqrt(f); 1: lr/f). Adam moves each trained coordinate by about lr, so a narrow window lowers the loss less
    # per step than the whole target (benchmarks/results/window_width_loss.md); this lets it move further instead
    window_lr_power: float = 0.0
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

    def tier_method(self, tier: str) -> str:
        """The method ``tier`` trains with: its ``tiers`` entry in a mixed federation (empty: none), else ``method``."""
        return self.tiers.get(tier, "") if self.method == MIXED else self.method

    def label(self, tiers: Iterable[str]) -> str:
        """The method as a run's header and plan name it (the slicing policy where its registry entry says so; a
        mixed federation's method per tier of ``tiers``, the population's)."""
        if self.method == MIXED:
            return f"{MIXED}(" + ", ".join(f"{tier}={self.tier_method(tier)}" for tier in tiers) + ")"
        return f"{self.method}/{self.policy}" if BY_NAME[self.method].policy_in_label else self.method

    def unread(self) -> tuple[str, ...]:
        """This section's keys the configured method never reads (``stagger`` outside the rolling policy: the
        registry's build passes it only there), so two runs that differ only in them trained the same way."""
        return () if self.policy == "rolling" else ("stagger",)

    def grow_rounds(self) -> int:
        """``grow_round`` as a round number; a fraction must have been resolved (loading does it once ``rounds`` is
        known), so a caller never reads a fraction as round 0."""
        if isinstance(self.grow_round, float):
            raise RecipeError(f"fusion.grow_round: the fraction {self.grow_round} is unresolved until rounds is known "
                              "(rounds=0: fedfusion.run.check.check_recipe sets it)")
        return self.grow_round

    def check(self) -> None:
        """``fusion.*`` on its own: widths and ladders, the aggregate, the outer step, axes (which method growth
        and windows go with: :meth:`check_windows`)."""
        for tier, width in self.widths.items():
            if not 0 < width <= 1:
                raise RecipeError(f"fusion.widths.{tier}: must be in (0, 1], got {width}")
        if self.max_norm_ratio < 0:
            raise RecipeError(f"fusion.max_norm_ratio: must be >= 0, got {self.max_norm_ratio}")
        if not self.width_ladder or not all(0 < w <= 1 for w in self.width_ladder):
            raise RecipeError(f"fusion.width_ladder: needs widths in (0, 1], got {self.width_ladder}")
        if not 0 <= self.trim < 0.5:
            raise RecipeError(f"fusion.trim: must be in [0, 0.5), got {self.trim}")
        positive("fusion.outer_lr", self.outer_lr)
        if not 0 <= self.outer_momentum < 1:
            raise RecipeError(f"fusion.outer_momentum: must be in [0, 1), got {self.outer_momentum}")
        if not 0 < self.stride <= 1:
            raise RecipeError(f"fusion.stride: must be in (0, 1], got {self.stride}")
        for axis in self.axes or ():
            if axis not in AXES:
                raise RecipeError(f"fusion.axes: {axis!r} is not one of {', '.join(AXES)}")
        if self.axes is not None and not self.axes:
            raise RecipeError("fusion.axes: name at least one axis, or leave it unset for the family's default")
        for width in self.ordered_ladder or ():
            if not 0 < width <= 1:
                raise RecipeError(f"fusion.ordered_ladder: widths must be in (0, 1], got {width}")

    def check_windows(self) -> None:
        """Growth is width slicing's and generative distillation's (its grow rounds are smallest-only slicing);
        full-forward windows are width slicing's, and a window reaches its own coordinates only with the ordinary
        policies."""
        if self.grow_round and self.method not in GROWS:
            raise RecipeError(f"fusion.grow_round: applies to fusion.method={' or '.join(GROWS)}, got {self.method!r}")
        if self.forward == "full" and self.method != SUBMODEL:
            raise RecipeError(f"fusion.forward=full: applies to fusion.method=submodel, got {self.method!r}")
        if self.forward == "full" and self.policy == "ordered":
            raise RecipeError("fusion.forward=full: policy 'ordered' trains nested sub-models in their own forward "
                              "pass; use static, rolling, random or owned")
        if self.window_rank < 0 or (self.window_rank and self.forward != "full"):
            raise RecipeError(f"fusion.window_rank: a rank >= 1 trains low-rank updates with fusion.forward=full "
                              f"(0: off), got {self.window_rank} with forward={self.forward}")
        if self.window_rank and (self.wire_up != "float32" or self.window_widths):
            raise RecipeError("fusion.window_rank: low-rank updates reply their factors in float32 and cover every "
                              "unit; leave fusion.wire_up at float32 and fusion.window_widths unset")
        if self.window_core and (self.forward != "full" or self.window_rank):
            raise RecipeError("fusion.window_core: adds the smallest width's units to a window of units "
                              f"(fusion.forward=full, window_rank 0), got forward={self.forward}, "
                              f"window_rank={self.window_rank}")
        if self.core_forward == "small" and not (self.window_core and self.window_shared):
            raise RecipeError("fusion.core_forward=small: the core is the small model inside a window that holds it "
                              f"whole; set fusion.window_core=true and fusion.window_shared=true, got "
                              f"window_core={self.window_core}, window_shared={self.window_shared}")
        if not 0 <= self.window_lr_power <= 1 or (self.window_lr_power and (self.forward != "full" or self.window_rank)):
            raise RecipeError("fusion.window_lr_power: a power in [0, 1] for a window of units (fusion.forward=full, "
                              f"window_rank 0), got {self.window_lr_power} with forward={self.forward}, "
                              f"window_rank={self.window_rank}")
        for tier, width in self.window_widths.items():
            if tier not in self.widths:
                raise RecipeError(f"fusion.window_widths.{tier}: not a tier of fusion.widths ({', '.join(self.widths)})")
            if not 0 < width <= 1:
                raise RecipeError(f"fusion.window_widths.{tier}: must be in (0, 1], got {width}")


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

    def check(self) -> None:
        """``selection.*``: positive counts and deadline, a bounded overselection, a quorum within the round."""
        for key in ("clients_per_round", "min_clients", "timeout_s"):
            positive(f"selection.{key}", getattr(self, key))
        if not 0 <= self.overselect <= 4:
            raise RecipeError(f"selection.overselect: must be in [0, 4] (extra clients sampled per round, as a "
                              f"fraction of clients_per_round), got {self.overselect}")
        if "seed" in self.options:
            raise RecipeError("selection.options.seed: the selector is seeded by the recipe's seed")
        if self.min_clients > self.clients_per_round:
            raise RecipeError(f"selection.min_clients: {self.min_clients} exceeds clients_per_round "
                              f"{self.clients_per_round}")


@dataclass
class AvailabilitySection:
    """When virtual devices may train (diurnal windows, battery, network; fedfusion.devices.availability)."""

    enabled: bool = False  # off: every client is always available and never drops out
    start_clock_s: float = 0.0  # simulated time of round 1, seconds after midnight UTC of day 0
    round_interval_s: float = 600.0  # simulated time between round starts (longer if the slowest client is)
    deadline_s: float = 0.0  # virtual round deadline: a client predicted slower drops out (0: none)
    model: dict[str, float] = field(default_factory=dict)  # AvailabilityConfig knobs, e.g. {wifi_prob: 0.8}

    def check(self) -> None:
        """``availability.*``: clock, interval and deadline are >= 0."""
        for name in ("start_clock_s", "round_interval_s", "deadline_s"):
            if getattr(self, name) < 0:
                raise RecipeError(f"availability.{name}: must be >= 0, got {getattr(self, name)}")


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

    def check(self) -> None:
        """``train.*``: positive steps, lr and shapes; the schedule's final fraction, the epoch cap and the
        evaluation interval in range."""
        for key in ("local_steps", "lr", "batch_size", "seq_len"):
            positive(f"train.{key}", getattr(self, key))
        if self.eval_every < 0:
            raise RecipeError(f"train.eval_every: must be >= 0 (rounds between central evaluations; 0: only round 0 "
                              f"and the last), got {self.eval_every}")
        if not 0 <= self.max_epochs < math.inf:
            raise RecipeError(f"train.max_epochs: must be a finite number >= 0 (passes over a client's examples per "
                              f"round; 0: off), got {self.max_epochs}")
        if not 0 < self.lr_final <= 1:
            raise RecipeError(f"train.lr_final: must be in (0, 1] (the last round's lr as a fraction of train.lr), "
                              f"got {self.lr_final}")


@dataclass
class FaultConfig:
    """Injected client faults, for testing and benchmarking robustness (all off by default)."""

    crash_prob: float = 0.0  # a sampled client raises instead of training
    straggler_prob: float = 0.0  # a sampled client sleeps straggler_delay_s before replying
    straggler_delay_s: float = 0.0
    corrupt_prob: float = 0.0  # a sampled client replies with NaN in its update

    def check(self) -> None:
        """``faults.*``: probabilities in [0, 1], a delay >= 0."""
        for name in ("crash_prob", "straggler_prob", "corrupt_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise RecipeError(f"faults.{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.straggler_delay_s < 0:
            raise RecipeError(f"faults.straggler_delay_s: must be >= 0, got {self.straggler_delay_s}")


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

    def check(self) -> None:
        """``privacy.*`` when a mode is on: a positive clipping norm and budget, delta < 1, DP-SGD's noise >= 0."""
        if self.mode == "none":
            return
        for name in ("clipping_norm", "epsilon", "delta"):
            positive(f"privacy.{name}", getattr(self, name))
        if self.delta >= 1:
            raise RecipeError(f"privacy.delta: must be < 1, got {self.delta}")
        if self.mode == "dp_sgd" and self.noise_multiplier < 0:
            raise RecipeError(f"privacy.noise_multiplier: must be > 0, or 0 to calibrate each client's noise to "
                              f"privacy.epsilon, got {self.noise_multiplier}")


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

    def check(self) -> None:
        """``engine.*``: positive client resources, server threads >= 0, a Ray address the engine can join."""
        for key in ("cpus_per_client", "threads_per_client"):
            positive(f"engine.{key}", getattr(self, key))
        if self.server_threads < 0:
            raise RecipeError(f"engine.server_threads: must be >= 0 (0: chosen each round), got {self.server_threads}")
        _check_ray_address(self.ray_address)


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

    def check(self) -> None:
        """``output.*``: the checkpoint interval is >= 0."""
        if self.checkpoint_every < 0:
            raise RecipeError(f"output.checkpoint_every: must be >= 0, got {self.checkpoint_every}")


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
    # steps a device taken offline (it missed a deadline) stays out before it gets units again, its weight blocks
    # sent anew (fedfusion.units.engine.UnitEngine.rejoin), doubled each time it fails in the step it came back in
    # (fedfusion.units.engine.Returns: a device gone for good costs a deadline at steps 1, 3, 7, 15, ... after it
    # left, a transient miss one step); 0: never again
    rejoin_after: int = 1
    # fault injection for tests and benchmarks: the device (client index) of this partition stops answering: each of
    # its nodes answers stall_after messages, then sleeps stall_s before each of the next stall_messages replies
    # (0: every reply from then on) and answers promptly again; -1: off. In simulation a sleeping node holds one of
    # the engine's actors (engine.cpus_per_client): other nodes queue when actors run out
    stall_partition: int = -1
    stall_after: int = 0
    stall_s: float = 0.0
    stall_messages: int = 0
    # links emulated for real (fedfusion.units.shaper): the server's transport hands each message on only when its
    # device's downlink would have delivered it and accepts each reply when its uplink would have (catalog rates,
    # rtt/2 each way, the server's links of units.server_device), so a run on loopback takes the links' time
    shape_links: bool = False
    # the devices' catalog link rates times this, for the planner, the timeline and the shaper alike (a shaped run
    # on loopback kept short, or links made slow enough that they, not the machine, set the step)
    link_scale: float = 1.0

    def runtime(self) -> UnitsRuntime:
        """The device runtime as ``fedfusion.units.timeline.simulate`` takes it: ``lanes``, or ``supernodes``."""
        return {"supernodes": self.supernodes} if self.supernodes > 1 else {"lanes": self.lanes}

    def check(self) -> None:
        """``units.*`` on its own, whatever the method (the units mode's rules, which read the train, model, data
        and population sections too, are the recipe's)."""
        for key in ("steps", "deadline_factor", "deadline_floor_s", "link_scale"):
            positive(f"units.{key}", getattr(self, key))
        if self.micro_batches < 0:
            raise RecipeError(f"units.micro_batches: must be >= 0 (0: chosen before the run from the devices' links), "
                              f"got {self.micro_batches}")
        for key in ("eval_every", "rejoin_after", "stall_messages"):
            if getattr(self, key) < 0:
                raise RecipeError(f"units.{key}: must be >= 0, got {getattr(self, key)}")
        if self.in_flight < 0:
            raise RecipeError(f"units.in_flight: must be >= 0 (0: every micro-batch), got {self.in_flight}")
        if self.lanes < 0:
            raise RecipeError(f"units.lanes: must be >= 0 (1: Flower's SuperNode, one message at a time; 0: no "
                              f"limit), got {self.lanes}")
        if self.supernodes < 1:
            raise RecipeError(f"units.supernodes: must be >= 1 (SuperNodes per device), got {self.supernodes}")
        if self.supernodes > 1 and self.lanes != 1:
            raise RecipeError(f"units.supernodes: {self.supernodes} SuperNodes per device hold one message each; "
                              f"units.lanes must be 1 with it, got {self.lanes}")


@dataclass(frozen=True)
class DataSource:
    """What the population's data is derived from, and all of the recipe the data modules read: the data section,
    how many clients share it, the run's seed and the pretrained model whose tokenizer reads it (None: the fixed
    character tokenizer, or a facts dataset's word tokenizer)."""

    data: DataConfig
    num_clients: int
    seed: int
    tokenizer: Optional[str] = None


def positive(key: str, value: float) -> None:
    """Raise RecipeError naming ``key`` unless ``value`` > 0 (shared by the sections in the methods' folders)."""
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
