"""Benchmark: measured leakage per fusion method. Canary exposure (Carlini et al., "The Secret Sharer", 2019) and fact
extraction, on the final target and on what the server receives from one client.

Task: recipes/knowledge.yaml's private facts (``fedfusion.data.facts``: synthetic biographies, Zipf-skewed over 16
clients, a word tokenizer) with canaries added. A canary is the sentence ``my secret number is d d d d d d d d d .``
with nine random digits (the secret; a candidate space R of 10^9 secrets, log2|R| = 29.9 bits). Three canaries, each
drawn by the seed, are inserted 1, 4 and 16 times (as that many documents of their own, at random places) into the
documents of three distinct clients drawn by the seed among those the run samples at least once; eight more are never
inserted anywhere (the references: their mean exposure is the noise floor). The canary clients' documents are
otherwise unchanged, and the tokenizer holds every digit and the template's words whether or not a canary is inserted.

Exposure of a canary under a scorer = log2|R| - log2(rank of the canary's score among all of R). The rank is
estimated from ``--candidates`` secrets drawn uniformly from R (the same sample for every canary and scorer):
with k candidates scoring better than the canary (ties count half), rank / |R| ~ (k + 1) / (n + 1), so the
sampled exposure is -log2((k + 1) / (n + 1)) and can be at most log2(n + 1) (12.0 bits at 4,095 candidates: a
canary that beats every sampled candidate reads "at least 12.0"). A second estimate extrapolates beyond the sample,
as Carlini et al. do: a skew-normal fitted to the candidates' scores gives the canary's tail probability
(``exposure_fit``, capped at log2|R|). A never-inserted canary's exposure is -log2 of a uniform draw: 1.44 bits on
average (the table's "never inserted" is the mean over the eight references). The score of a secret is the
model's summed negative log-likelihood of the whole canary sentence (after ``<bos>``), the log-perplexity Carlini et al. rank.

Views, per method:

- final target: the target the run ends with;
- server's view of the canary's client: what the server can build from that client's last reply of the run (its
  last round sampled). Parameter methods: the library's own fold of that single reply into the round's target
  (``fusion.rounds.fold_round`` with only that client's checked update: the target with that client's slice, window
  or core trained values in place of the others'), scored as a model; distillation: the client's trained family model
  (its static slice of that single-reply fold, the model whose logits the server distils); generative: the reply is
  token samples and each position's top-k log-probabilities, no model: the canary is scored by an interpolated
  trigram model (fixed weights 0.5/0.3/0.15/0.05 over trigram, bigram, unigram and uniform) whose counts are the
  reply's top-k probabilities at every sampled position (the sampled tokens where no top-k is sent), and the table
  also says whether the canary's nine digits occur in the samples verbatim.

Extraction rate (the same runs): the share of a canary client's own facts (its probes: prompt, then the answer)
that the server reads off its view: greedy completion by the view model (``fedfusion.data.facts.probe_hits``), or
for generative, the share of its facts whose prompt and answer tokens occur verbatim, in order and contiguous, in its
samples; mean over the three canary clients, next to the final target's recall of the same facts.

Methods (each on the knowledge recipe's model, data, rounds and local training; the fusion settings of the recipe
named; ``fusion.lr_schedule`` and ``max_epochs`` are not applied by the in-process driver, and the knowledge recipe
uses neither):

- ``grown``: recipes/quickstart.yaml's fusion (its device mix and widths over 16 clients, the small model for the
  first third of the rounds, grown into the target, then full-forward windows with the core, int8 frozen target);
- ``rolling``: recipes/rolling.yaml's fusion (rolling, staggered slices in their own forward pass, its device mix);
- ``distill``: FedDF on the facts' public biographies (the library's ``run_transfer``: every client trains the phones'
  1/8 slice as one family model; every round the server distils it into the target with the generative method's
  server steps and lr); the recipes' ``distill`` method itself runs on Shakespeare and is not measured here;
- ``generative``: recipes/knowledge.yaml as it is (phones' own 1/8 models, samples with top-8 log-probabilities);
- ``lora``: recipes/finetune.yaml's LoRA section as it is (its device mix, ranks 8 / 16 / 32 for 2 GB phones / phones /
  laptops on all seven linear layers, FlexLoRA, alpha 16) on a frozen base: the target the server first trains on the
  public biographies (people no client holds) for as many steps as the run's rounds x local steps, as a pretrained
  model would come (``fedfusion.fusion.lora.inprocess.run_lora``); the server's view of a client is the base with that
  client's adapter as the global update, the final target the base with the run's global update;
- ``mixed``: recipes/mixed.yaml's fusion (phones train a tiny Llama of their own, distilled into the target on the public
  biographies with its Fed-ET teacher and back-distillation; laptops and desktops rolling, staggered slices;
  ``fedfusion.fusion.inprocess.run_mixed``); a phone's view is the family model it sent;
- ``units``: the data sits on the server by design (a row, no number).

Every method runs through the library's in-process driver (``fedfusion.fusion.inprocess``: ``run_submodel``,
``run_transfer``, ``run_mixed``; ``fedfusion.fusion.generative.inprocess.run_generative``,
``fedfusion.fusion.lora.inprocess.run_lora``; the same method objects as the Flower strategy); the replies are read
by wrapping the driver's ``run_rounds`` while a run lasts (:func:`capturing`), with nothing in the library changed.

    python benchmarks/privacy.py --seeds 0 1 2 [--methods grown rolling distill generative lora mixed] [--people 200]
        [--candidates 4095] [--jobs 2] [--quick] [--out privacy]

``--quick``: one seed, 60 people, 6 rounds, 511 candidates (a smoke run; writes ``<out>_quick``). ``--report-only``:
rewrite ``<out>.md`` from ``<out>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel

import fedfusion.fusion.inprocess as inprocess
from fedfusion.config.recipe import Recipe, load_recipe
from fedfusion.config.sections import TrainConfig
from fedfusion.data.facts import (
    Probe,
    build_word_tokenizer,
    encode_documents,
    encode_probes,
    load_facts,
    probe_hits,
    write_facts,
)
from fedfusion.data.text import read_jsonl
from fedfusion.devices.catalog import assign_tiers
from fedfusion.fusion.base import Payload
from fedfusion.fusion.distill.build import distill_method
from fedfusion.fusion.distill.method import DistillMethod
from fedfusion.fusion.generative.inprocess import GenerativeRun, run_generative
from fedfusion.fusion.generative.reply import SAMPLES_KEY, TOP_IDS_KEY, TOP_LOGP_KEY
from fedfusion.fusion.inprocess import (
    Rounds,
    SubModelRun,
    TransferRun,
    family_model,
    run_mixed,
    run_submodel,
    run_transfer,
)
from fedfusion.fusion.lora.inprocess import LoRARun, run_lora, with_update
from fedfusion.fusion.outer import OuterConfig
from fedfusion.fusion.rounds import fold_round
from fedfusion.models.build import model_from_state, target_config
from fedfusion.models.families import family_of
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.run.check import facts_rounds
from fedfusion.train.loop import train_steps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import run_facts, write_pair  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TEMPLATE = "my secret number is {secret} ."
DIGITS = 9
INSERTIONS = (1, 4, 16)  # canaries inserted this many times; 0 in tables: the never-inserted references
REFERENCES = 8  # never-inserted canaries: their mean exposure is the noise floor (one alone varies by ~1.4 bits)
CANARY_VOCAB = TEMPLATE.format(secret=" ".join("0123456789"))  # the tokenizer holds every word a canary can use
SPACE_BITS = DIGITS * math.log2(10)
METHODS = ("grown", "rolling", "distill", "generative", "lora", "mixed")
DEFAULT_METHODS = METHODS[:4]  # privacy.md's; lora and mixed are measured by their own command (privacy_lora_mixed)
# methods whose replies secure aggregation can sum (their fold is a sum over clients): under it the server learns the
# round's folded target only; distillation needs each client's own model and generative each client's samples
SECURE = ("grown", "rolling", "lora")
NOT_MEASURED = {
    "units": "the data sits on the server by design (the units mode pools devices' compute on the data owner's "
             "server): nothing to measure",
}
METHOD_TEXT = {  # each method's settings, as its report states them
    "grown": "takes recipes/quickstart.yaml's fusion (its device mix and widths over the clients; the small model for "
             "the first third of the rounds, grown into the target, then full-forward windows with the core on an "
             "int8 frozen target)",
    "rolling": "recipes/rolling.yaml's (rolling, staggered slices in their own forward pass, its device mix)",
    "distill": "FedDF on the facts' public biographies (every client trains the phones' 1/8 slice as one family "
               "model; every round the server distils it into the target with the generative method's server steps)",
    "generative": "recipes/knowledge.yaml's (phones' own 1/8 models, samples with top-8 log-probabilities, kept on the "
                  "node)",
    "lora": "recipes/finetune.yaml's LoRA section (its device mix, ranks 8 / 16 / 32, all seven linear layers, "
            "FlexLoRA) on a frozen base the server first trains on the public biographies for rounds x local steps",
    "mixed": "recipes/mixed.yaml's (phones' own tiny Llama distilled with Fed-ET on the public biographies, laptops' "
             "and desktops' rolling slices)",
}
WHOLE_MODEL = ("final", "base")  # views that are one model for the whole run (the others: one per canary client)
TRIGRAM_WEIGHTS = (0.5, 0.3, 0.15, 0.05)  # trigram, bigram, unigram, uniform: fixed, not fitted to any run


# ---------------------------------------------------------------- canaries and exposure (the math the test checks)

def secret_text(digits: Sequence[int]) -> str:
    """The canary sentence of one secret."""
    return TEMPLATE.format(secret=" ".join(str(d) for d in digits))


def draw_secrets(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """``n`` secrets drawn uniformly from R (with replacement: at 10^9 secrets, repeats are negligible)."""
    return [tuple(rng.randrange(10) for _ in range(DIGITS)) for _ in range(n)]


def encode_secrets(tok, secrets: Sequence[Sequence[int]]) -> torch.Tensor:
    """(n, T) token ids of ``<bos>`` + each secret's canary sentence (every sentence has the same length)."""
    rows = [[tok.bos_token_id, *tok.encode(secret_text(s), add_special_tokens=False)] for s in secrets]
    if len({len(r) for r in rows}) != 1 or tok.unk_token_id in {t for r in rows for t in r}:
        raise ValueError("canary sentences must tokenise to known words of one length")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, ids: torch.Tensor, batch: int = 1024) -> torch.Tensor:
    """Per row: the model's summed negative log-likelihood (nats) of every token after the first."""
    model.eval()
    out = []
    for i in range(0, len(ids), batch):
        rows = ids[i: i + batch]
        logits = model(input_ids=rows[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")
        out.append(loss.sum(dim=1))
    return torch.cat(out)


def exposure(score: float, candidates: torch.Tensor | np.ndarray, space_bits: float = SPACE_BITS) -> dict[str, float]:
    """Exposure of a canary whose score (lower = likelier) is ``score`` among a uniform sample of the candidate
    space's scores: ``sampled`` = -log2((k + 1) / (n + 1)) with k the candidates scoring better (ties half), at most
    log2(n + 1); ``fit`` = -log2 of the canary's lower tail under a skew-normal fitted to the candidates (capped at
    ``space_bits``; the sampled estimate where the fit fails); ``rank_share`` = k / n."""
    from scipy import stats

    c = np.asarray(candidates, dtype=np.float64)
    k = float((c < score).sum() + 0.5 * (c == score).sum())
    sampled = -math.log2((k + 1) / (len(c) + 1))
    try:
        with np.errstate(all="ignore"):
            a, loc, scale = stats.skewnorm.fit(c)
            tail = float(stats.skewnorm.logcdf(score, a, loc, scale)) / math.log(2)
        fit = min(space_bits, -tail) if math.isfinite(tail) else sampled
    except (ValueError, RuntimeError, FloatingPointError):
        fit = sampled
    return {"sampled": sampled, "fit": max(0.0, fit), "rank_share": k / len(c), "cap": math.log2(len(c) + 1)}


def contains(haystack: torch.Tensor, needle: Sequence[int]) -> bool:
    """Whether the rows of ``haystack`` (n, L) hold ``needle`` contiguously somewhere."""
    m = len(needle)
    if m == 0 or haystack.shape[-1] < m:
        return m == 0
    windows = haystack.unfold(-1, m, 1)  # (n, L - m + 1, m)
    return bool((windows == torch.tensor(list(needle), dtype=haystack.dtype)).all(-1).any())


class SampleScorer:
    """What a generative reply lets the server score: an interpolated trigram model over the reply's token samples,
    counting at each sampled position the client model's top-k probabilities of the next token where the reply
    carries them (else the sampled token)."""

    def __init__(self, samples: torch.Tensor, vocab: int, top_ids: torch.Tensor | None = None,
                 top_logp: torch.Tensor | None = None) -> None:
        self.vocab = vocab
        self.counts: list[dict[tuple[int, ...], Counter]] = [defaultdict(Counter) for _ in range(3)]
        rows = samples.tolist()
        for i, row in enumerate(rows):
            for t in range(len(row) - 1):  # the next token after position t
                if top_ids is not None and top_logp is not None:
                    nxt = dict(zip(top_ids[i, t].tolist(), top_logp[i, t].float().exp().tolist()))
                else:
                    nxt = {row[t + 1]: 1.0}
                for order in range(3):  # context of 0, 1 and 2 tokens
                    if t + 1 - order < 0:
                        continue
                    ctx = tuple(row[t + 1 - order: t + 1])
                    for tok, w in nxt.items():
                        self.counts[order][ctx][tok] += w
        self.totals = [{ctx: sum(c.values()) for ctx, c in table.items()} for table in self.counts]

    def prob(self, history: Sequence[int], token: int) -> float:
        """p(token | the last two tokens of history), interpolated with :data:`TRIGRAM_WEIGHTS` over the orders whose
        context was seen (the weight of an unseen context goes to the others, in proportion)."""
        parts, weights = [1.0 / self.vocab], [TRIGRAM_WEIGHTS[3]]
        for order in range(3):
            if order > len(history):
                continue
            ctx = tuple(history[len(history) - order:]) if order else ()
            total = self.totals[order].get(ctx, 0.0)
            if total > 0:
                parts.append(self.counts[order][ctx][token] / total)
                weights.append(TRIGRAM_WEIGHTS[2 - order])
        return sum(p * w for p, w in zip(parts, weights)) / sum(weights)

    def nll(self, ids: torch.Tensor) -> torch.Tensor:
        """Per row: summed negative log-probability (nats) of every token after the first."""
        out = []
        for row in ids.tolist():
            out.append(-sum(math.log(self.prob(row[:t], row[t])) for t in range(1, len(row))))
        return torch.tensor(out)


# ---------------------------------------------------------------- the task

@dataclass
class Task:
    """One seed's data: the target config, tokenizer, each client's windows, the canaries and their clients, the
    candidate sample, each client's probes and the public transfer windows."""

    config: object
    tok: object
    windows: list[torch.Tensor]
    canaries: dict[int, tuple[int, ...]]  # insertions -> secret
    holders: dict[int, int]  # insertions -> the partition holding that canary
    canary_ids: dict[int, torch.Tensor]  # insertions -> (1, T) ids
    reference_ids: torch.Tensor  # (REFERENCES, T): the never-inserted canaries
    candidate_ids: torch.Tensor
    probes: dict[int, list[Probe]]  # partition -> its probes
    transfer: torch.Tensor
    public: list[str]  # the public biographies (the transfer text)


def schedule(rounds: int, per_round: int, population: int, seed: int) -> list[list[int]]:
    """The partitions each round samples: the driver's own draw (:meth:`fedfusion.fusion.inprocess.Rounds.draw`
    with its seeded generator), repeated here to know before the run which clients it samples."""
    rng, spec = random.Random(seed), Rounds(per_round=per_round, seed=seed)
    return [spec.draw(rng, population) for _ in range(rounds)]


def build_task(seed: int, people: int, clients: int, rounds: int, per_round: int, candidates: int,
               workdir: Path) -> Task:
    """The facts of ``seed`` with the seed's canaries inserted into three sampled clients' documents."""
    paths = write_facts(workdir / f"facts-{seed}", clients, people, seed, public=people)
    facts = load_facts(paths["train"], paths["probes"])
    rng = random.Random(f"privacy-canaries-{seed}")
    secrets = draw_secrets(rng, len(INSERTIONS) + REFERENCES)
    canaries = dict(zip(INSERTIONS, secrets))
    sampled = sorted({p for rnd in schedule(rounds, per_round, clients, seed) for p in rnd})
    chosen = rng.sample(sampled, len(INSERTIONS))
    holders = dict(zip(INSERTIONS, chosen))
    documents = [list(d) for d in facts.documents]
    for n, partition in holders.items():
        for _ in range(n):
            documents[partition].insert(rng.randrange(len(documents[partition]) + 1), secret_text(canaries[n]))
    texts = [d for docs in documents for d in docs]
    tok = build_word_tokenizer([*texts, *(p.prompt for p in facts.probes), *(p.answer for p in facts.probes),
                                CANARY_VOCAB])
    recipe = load_recipe("knowledge", [f"seed={seed}"])
    config = target_config(recipe.model, tok)
    seq_len = recipe.train.seq_len
    windows = [encode_documents(tok, docs, seq_len) for docs in documents]
    by_client: dict[int, list[Probe]] = defaultdict(list)
    for p in facts.probes:
        by_client[facts.clients.index(p.client)].append(p)
    public = [str(r["text"]) for r in read_jsonl(paths["public"], ("client", "text"))]
    candidate_ids = encode_secrets(tok, draw_secrets(random.Random(f"privacy-candidates-{seed}"), candidates))
    return Task(config, tok, windows, canaries, holders, {n: encode_secrets(tok, [s]) for n, s in canaries.items()},
                encode_secrets(tok, secrets[len(INSERTIONS):]), candidate_ids, dict(by_client), encode_documents(tok, public, seq_len),
                public)


# ---------------------------------------------------------------- reading the replies

@contextlib.contextmanager
def capturing(on_reply: Callable[[dict, int, Payload, dict], None],
              on_round: Callable[[int, dict], None]) -> Iterator[None]:
    """While the block runs, every in-process run's client replies are shown to ``on_reply(methods, round, payload,
    reply)`` after the client trains, before the driver checks and folds them, and every round's folded target to
    ``on_round(round, target)``: the driver's ``run_rounds`` is wrapped for the block (every in-process loop calls
    it by its module name) and restored after."""
    original = inprocess.run_rounds

    def wrapped(methods, tiers, initial, train, rounds, evaluate=None, weighting="uniform", caps=None):
        def watched(rnd: int, payload: Payload):
            reply, metrics = train(rnd, payload)
            on_reply(methods, rnd, payload, reply)
            return reply, metrics

        def folded(target: dict, rnd: int):
            on_round(rnd, target)
            return evaluate(target, rnd) if evaluate is not None else None

        return original(methods, tiers, initial, watched, rounds, folded, weighting, caps)

    inprocess.run_rounds = wrapped
    try:
        yield
    finally:
        inprocess.run_rounds = original


def single_fold(methods: dict, rnd: int, payload: Payload, reply: dict) -> dict[str, torch.Tensor]:
    """The round's target with only this reply folded in (the library's check and fold, on a copy of the methods so
    the run's own state is untouched)."""
    methods = copy.deepcopy(methods)
    method = methods[payload.client.tier]
    update = method.check(payload, reply, 1.0)
    # a slice's payload carries the round's target (its context: plan, target, low-rank); LoRA's fold reads the
    # replies only (the global update is the folded adapters)
    start = payload.context[1] if method.name == "submodel" else {}
    return fold_round(methods, rnd, start, [update]).target


# ---------------------------------------------------------------- one run

def pretrained_base(config: PretrainedConfig, initial: dict[str, torch.Tensor], task: Task, steps: int,
                    train: TrainConfig, seed: int) -> PreTrainedModel:
    """LoRA's frozen base: the target from ``initial`` trained by the server on the public biographies (people no
    client holds) for ``steps`` steps with the clients' optimizer, lr and batch, as a pretrained model would come."""
    base = model_from_state(config, initial)
    train_steps(base, task.transfer, steps, train.lr, train.batch_size, seed, train.weight_decay, train.optimizer)
    return base.eval()


def mixed_families(recipe: Recipe, task: Task, seq_len: int, seed: int) -> DistillMethod:
    """The mixed recipe's distillation (its families, teacher and server steps) for its distilled tiers, on the facts:
    the families sized to the task's tokenizer and target, the public biographies (one text, as the recipe's
    Shakespeare transfer set is) cut into the task's ``seq_len`` windows."""
    tiers = [t for t, method in recipe.fusion.tiers.items() if method == "distill"]
    return distill_method(recipe.distill, task.config, task.tok, "\n".join(task.public),
                          task.config.max_position_embeddings, seq_len, seed, tiers)


def method_recipe(name: str, seed: int, clients: int, rounds: int):
    """The recipe whose fusion settings ``name`` takes, its population resized to ``clients`` and its rounds set to
    ``rounds`` (so a ``fusion.grow_round`` fraction resolves against them)."""
    recipe = {"grown": "quickstart", "rolling": "rolling", "lora": "finetune", "mixed": "mixed"}.get(name, "knowledge")
    return load_recipe(recipe, [f"seed={seed}", f"population.num_clients={clients}", f"rounds={rounds}"])


def scores_of(nll: Callable[[torch.Tensor], torch.Tensor], task: Task, which: Sequence[int]) -> dict[int, dict]:
    """Exposure of the canaries ``which`` (insertions; 0: the mean over the never-inserted references, each one's
    sampled exposure kept under ``each``) under one scorer."""
    cand = nll(task.candidate_ids).numpy()
    out = {n: exposure(float(nll(task.canary_ids[n])[0]), cand) for n in which if n}
    if 0 in which:
        refs = [exposure(float(x), cand) for x in nll(task.reference_ids)]
        out[0] = {**{k: statistics.mean(r[k] for r in refs) for k in refs[0]}, "each": [r["sampled"] for r in refs]}
    return out


def extraction(model: torch.nn.Module, task: Task, partition: int) -> float:
    """The share of ``partition``'s facts that greedy completion by ``model`` answers exactly."""
    return float(probe_hits(model, encode_probes(task.tok, task.probes[partition])).float().mean())


def verbatim_facts(samples: torch.Tensor, task: Task, partition: int) -> float:
    """The share of ``partition``'s facts whose prompt and answer tokens occur contiguously in ``samples``."""
    hits = [contains(samples, task.tok.encode(f"{p.prompt} {p.answer}", add_special_tokens=False))
            for p in task.probes[partition]]
    return sum(hits) / len(hits)


def run_method(job: dict) -> dict:
    """One (method, seed): exposures and extraction rates on the final target and on each canary client's view."""
    torch.set_num_threads(1)
    a, name, seed = job["args"], job["method"], job["seed"]
    start = time.perf_counter()
    knowledge = load_recipe("knowledge", [f"seed={seed}"])
    rounds = a["rounds"] or facts_rounds(6 * a["people"], knowledge.data.facts_per_round)
    per_round, t = knowledge.selection.clients_per_round, knowledge.train
    with tempfile.TemporaryDirectory() as tmp:
        task = build_task(seed, a["people"], a["clients"], rounds, per_round, a["candidates"], Path(tmp))
    cfg = task.config
    last, trained = {}, Counter()  # partition -> last round it is sampled, and how many rounds it trains
    for rnd, sampled in enumerate(schedule(rounds, per_round, a["clients"], seed), start=1):
        for p in sampled:
            last[p] = rnd
            trained[p] += 1
    holder_of = {p: n for n, p in task.holders.items()}
    views: dict[int, dict] = {}
    secure: dict[int, dict] = {}  # partition -> its view under secure aggregation (the round's folded target)
    recipe = method_recipe(name, seed, a["clients"], rounds)
    f = recipe.fusion
    tiers = assign_tiers(recipe.population.mix, a["clients"], seed)
    smallest = min(f.widths.values())
    widths = [f.widths.get(tier, smallest) for tier in tiers]  # mixed: the phones train their family, not a slice
    axes = tuple(f.axes) if f.axes else None
    small = plan_slice(cfg, smallest, "static", axes=axes)
    torch.manual_seed(seed)
    initial = family_of(cfg).build(cfg).state_dict()
    common = dict(rounds=rounds, per_round=per_round, steps=t.local_steps, lr=t.lr, batch_size=t.batch_size, seed=seed,
                  weight_decay=t.weight_decay, optimizer=t.optimizer, dp_epsilon=a.get("epsilon", 0.0))
    base = pretrained_base(cfg, initial, task, rounds * t.local_steps, t, seed) if name == "lora" else None
    floor = {}  # LoRA: what the pretrained base alone scores, before any client's update
    if base is not None:
        floor = {"base": {str(n): e for n, e in scores_of(lambda ids: sequence_nll(base, ids), task,
                                                          (*INSERTIONS, 0)).items()},
                 "base_extraction": {str(p): extraction(base, task, p) for p in task.holders.values()}}
    families = mixed_families(recipe, task, t.seq_len, seed) if name == "mixed" else None

    @contextlib.contextmanager
    def target_model(state: dict) -> Iterator[torch.nn.Module]:
        """The target a state stands for: LoRA's base with the global update, else the target itself."""
        if base is not None:
            with with_update(base, state) as model:
                yield model
        else:
            yield model_from_state(cfg, state)

    @contextlib.contextmanager
    def view_model(state: dict) -> Iterator[torch.nn.Module]:
        """What the server holds of one client's reply folded alone: distillation's family model (the static
        slice), else the target the fold makes."""
        if name == "distill":
            yield model_from_state(sub_config(cfg, small), extract(state, cfg, small))
        else:
            with target_model(state) as model:
                yield model

    def model_view(partition: int, model: torch.nn.Module) -> dict:
        return {"exposure": scores_of(lambda ids: sequence_nll(model, ids), task, (holder_of[partition], 0)),
                "extraction": extraction(model, task, partition)}

    def on_reply(methods: dict, rnd: int, payload: Payload, reply: dict) -> None:
        partition = payload.client.partition
        if partition not in holder_of or rnd != last[partition]:
            return
        if SAMPLES_KEY in reply:  # generative: samples (and top-k), no model
            samples = reply[SAMPLES_KEY].long()
            scorer = SampleScorer(samples, cfg.vocab_size, reply.get(TOP_IDS_KEY), reply.get(TOP_LOGP_KEY))
            secret = task.canary_ids[holder_of[partition]][0, -DIGITS - 1:-1].tolist()
            views[partition] = {"exposure": scores_of(scorer.nll, task, (holder_of[partition], 0)),
                                "extraction": verbatim_facts(samples, task, partition),
                                "secret_in_samples": contains(samples, secret),
                                "never_in_samples": any(contains(samples, r[-DIGITS - 1:-1].tolist())
                                                        for r in task.reference_ids),
                                "samples": len(samples)}
        elif isinstance(methods[payload.client.tier], DistillMethod):  # mixed: the family model it sent
            views[partition] = {**model_view(partition, family_model(payload, reply)), "kind": "family model"}
        else:
            with view_model(single_fold(methods, rnd, payload, reply)) as model:
                views[partition] = model_view(partition, model)
        views[partition].update(round=rnd, tier=payload.client.tier)

    def on_round(rnd: int, target: dict) -> None:
        if name in SECURE:
            for partition in holder_of:
                if last[partition] == rnd:
                    with view_model(target) as model:
                        secure[partition] = {**model_view(partition, model), "round": rnd}

    g = knowledge.generative
    with capturing(on_reply, on_round):
        if name in ("grown", "rolling", "mixed"):
            run = SubModelRun(cfg, task.windows, widths, policy=f.policy, stride=f.stride,
                              stagger=f.stagger and f.policy == "rolling", axes=axes, scale=f.scaler,
                              outer=OuterConfig(f.outer, f.outer_lr, f.outer_momentum), forward=f.forward,
                              frozen=f.frozen_dtype, window_shared=f.window_shared,
                              grow_round=int(f.grow_round), window_rank=f.window_rank, window_core=f.window_core,
                              core_forward=f.core_forward, **common)
            if families is not None:
                final, _ = run_mixed(run, tiers, families, initial)
            else:
                final, _ = run_submodel(run, initial)
        elif name == "distill":
            run = SubModelRun(cfg, task.windows, [smallest] * len(widths), policy="static", axes=axes,
                              scale=f.scaler, **common)
            transfer = TransferRun(run, task.transfer, every=1, steps=g.server_steps, lr=g.server_lr,
                                   batch_size=g.server_batch)
            final, _ = run_transfer(transfer, initial, initial)
        elif name == "generative":
            run = GenerativeRun(cfg, smallest, task.windows, axes, generative=g, **common)
            final, _, _ = run_generative(run, initial)
        elif base is not None:
            lora = recipe.lora
            run = LoRARun(base=base, windows=task.windows, tiers=tiers, ranks=lora.ranks, alpha=lora.alpha,
                          modules=tuple(lora.target_modules), method=lora.method, dropout=lora.dropout, **common)
            final, _ = run_lora(run)
        else:
            raise ValueError(f"no such method {name!r}")
    with target_model(final) as target:
        final_exposure = scores_of(lambda ids: sequence_nll(target, ids), task, (*INSERTIONS, 0))
        final_extraction = {str(p): extraction(target, task, p) for p in task.holders.values()}
    return {"method": name, "seed": seed, "rounds": rounds, "holders": {str(n): p for n, p in task.holders.items()},
            "final": {str(n): e for n, e in final_exposure.items()},
            "final_extraction": final_extraction, **floor,
            "views": {str(holder_of[p]): {**v, "exposure": {str(n): e for n, e in v["exposure"].items()}}
                      for p, v in views.items()},
            "secure": {str(holder_of[p]): {**v, "exposure": {str(n): e for n, e in v["exposure"].items()}}
                       for p, v in secure.items()},
            "facts": {str(p): len(task.probes[p]) for p in task.holders.values()},
            "epsilon_spent": {str(n): run.spent(len(task.windows[p]), a["clients"], trained[p])
                              for n, p in task.holders.items()},
            "wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------- the report

def _private_lines(a: dict, runs: list[dict]) -> list[str]:
    """With ``--epsilon``: the DP-SGD setting and what the canary clients spent."""
    if not a.get("epsilon"):
        return []
    spent = [e for r in runs for e in r.get("epsilon_spent", {}).values()]
    return [f"DP-SGD on every client (`privacy.mode=dp_sgd`, per-example clipping norm 1, delta 1e-5): each client's "
            f"noise calibrated to spend epsilon {a['epsilon']:g} over the rounds it is expected to train (as "
            "`privacy.noise_multiplier=0` does); the in-process driver leaves no client out for its budget, so one "
            f"sampled more often than expected spends more: the canary clients spent {min(spent):.3g} to "
            f"{max(spent):.3g}.", ""]


def _ms(values: Sequence[float], digits: int = 2) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def _canary_exposures(runs: list[dict], view: str, n: int, key: str = "sampled") -> list[float]:
    """The ``n``-times canary's exposure (``key``: ``sampled`` or ``fit``) under ``view`` in each seed that has it."""
    if view in WHOLE_MODEL:
        return [r[view][str(n)][key] for r in runs if view in r]
    return [r[view][str(n)]["exposure"][str(n)][key] for r in runs if str(n) in r.get(view, {})]


def cells(runs: list[dict], view: str, key: str) -> list[str]:
    """The table's exposure cells (1x, 4x, 16x, never) of one view (``final``, ``base``: LoRA's pretrained base alone,
    ``views``: the server's view of one reply, or ``secure``: under secure aggregation) and estimate (``sampled`` or
    ``fit``): mean ± sd over seeds; the never-inserted canary under a server's view is each seed's mean over the three
    canary clients' views."""
    out = [_ms(_canary_exposures(runs, view, n, key)) for n in INSERTIONS]
    if view in WHOLE_MODEL:
        floor = [r[view]["0"][key] for r in runs if view in r]
    else:
        floor = [statistics.mean(f) for r in runs if (f := [v["exposure"]["0"][key] for v in r.get(view, {}).values()])]
    return [*out, _ms(floor)]


def fisher_p(exposures: Sequence[float]) -> float:
    """The chance that canaries never trained on score ``exposures`` (sampled, one per seed) or more, all seeds
    together. A canary drawn like the candidates ranks uniformly among them, so its sampled exposure ``e`` has the
    exact p-value 2^-e; Fisher's method combines k of them: -2 sum ln p is chi-squared with 2k degrees of freedom,
    whose survival function at x is exp(-x/2) sum_{j<k} (x/2)^j / j!."""
    half = sum(e * math.log(2) for e in exposures)  # -sum ln p = x / 2
    return math.exp(-half) * sum(half ** j / math.factorial(j) for j in range(len(exposures)))




def leak_cells(runs: list[dict], view: str) -> list[str]:
    """Per insertion count: :func:`fisher_p` of the canary's exposures over the seeds; then the never-inserted
    canaries' mean exposure under the view, the calibration check (1/ln 2 = 1.44 bits expected with no leak)."""
    cells = []
    for n in INSERTIONS:
        values = _canary_exposures(runs, view, n)
        cells.append(f"{fisher_p(values):.2g}" if values else "-")
    refs = ([x for r in runs if view in r for x in r[view]["0"].get("each", [])] if view in WHOLE_MODEL else
            [x for r in runs for v in r.get(view, {}).values() for x in v["exposure"]["0"].get("each", [])])
    return [*cells, f"{statistics.mean(refs):.2f} ({len(refs)})" if refs else "-"]


def report(payload: dict) -> str:
    a, runs = payload["args"], payload["runs"]
    by = {m: [r for r in runs if r["method"] == m] for m in a["methods"]}
    cap = math.log2(a["candidates"] + 1)
    rounds = sorted({r["rounds"] for r in runs})
    lines = [
        "# Measured leakage per method: canary exposure and fact extraction", "",
        f"Machine: {payload['machine']}; torch {payload['torch']}; {a['jobs']} processes x 1 thread; load before "
        f"{payload['load_before']}.", "",
        f"Settings: recipes/knowledge.yaml's facts task ({a['people']} people over {a['clients']} clients, Zipf skew 1, "
        f"its model, {', '.join(map(str, rounds))} rounds of 6 clients, 20 local AdamW steps at lr 0.003, batch 32, "
        f"seq_len 48) with canaries `{TEMPLATE.format(secret='d d d d d d d d d')}` (9 random digits, log2|R| = "
        f"{SPACE_BITS:.1f} bits) inserted 1, 4 and 16 times into three clients drawn by the seed among those the run "
        f"samples, and eight never inserted (the references). Seeds {', '.join(str(s) for s in a['seeds'])}; every cell is mean ± sd over "
        "seeds.", "", *_private_lines(a, runs),
        "Methods, each through the library's in-process driver (`fedfusion.fusion.inprocess`) on the same task, "
        "rounds and local training: " + "; ".join(f"`{m}` {METHOD_TEXT[m]}" for m in a["methods"]) + ".", "",
        f"Exposure = log2|R| - log2(rank), the rank estimated from {a['candidates']:,} secrets drawn uniformly from R "
        f"(the same for every canary and view): -log2((k + 1) / (n + 1)) with k the candidates scoring better, so at "
        f"most {cap:.1f} bits (a canary better than every candidate). A never-inserted canary averages 1.44 bits; the "
        "never-inserted cells are the mean over the eight references. "
        "Server's view: what the server can build from the canary client's last reply (parameter methods: that reply "
        "alone folded into the round's target by the library's fold; LoRA: the base with that client's adapter as "
        "the global update; distill and a mixed federation's phones: the client's family model; generative: "
        "a trigram model of its samples' top-8 probabilities). The references' server-view cell is, per seed, "
        "their mean over the three canary clients' views. Under secure aggregation (the methods whose fold is a sum "
        "over clients, which `privacy.secure_aggregation` masks) the server learns only the round's sum: its view is "
        "the target folded from every reply of the canary client's last round (identical to the plain fold within "
        "rounding, tests/test_secagg.py and tests/test_secagg_lora.py); distillation needs each client's model and "
        "generative each client's samples, so neither runs under it.", "",
        "## Exposure (bits), sampled rank", "",
        "| method | view | inserted 1x | inserted 4x | inserted 16x | never inserted |", "|---|---|---|---|---|---|"]
    for m, mine in by.items():
        if mine:
            lines.append(f"| {m} | final target | " + " | ".join(cells(mine, "final", "sampled")) + " |")
            if any("base" in r for r in mine):
                lines.append(f"| {m} | the pretrained base alone (no client's update) | "
                             + " | ".join(cells(mine, "base", "sampled")) + " |")
            lines.append(f"| {m} | server's view of the canary's client | "
                         + " | ".join(cells(mine, "views", "sampled")) + " |")
            if any(r.get("secure") for r in mine):
                lines.append(f"| {m} | under secure aggregation (the round's sum) | "
                             + " | ".join(cells(mine, "secure", "sampled")) + " |")
    for m, why in NOT_MEASURED.items():
        lines.append(f"| {m} | - | {why} | | | |")
    lines += ["", "## Is a canary told apart from secrets never trained on?", "",
              "A canary drawn like the candidates ranks uniformly among them, so with no leak its sampled exposure e "
              "has the exact p-value 2^-e (P(e >= 4.32 bits) = 0.05). Each cell combines the seeds' canaries by "
              "Fisher's method: the chance that secrets never trained on score as high as they do, in every seed "
              "together; small means the view tells the canary apart. The tables hold several cells, so a single p "
              "near 0.05 is expected by chance somewhere; the never-inserted canaries' mean exposure (1.44 bits "
              "expected) checks the calibration.", "",
              "| method | view | inserted 1x | inserted 4x | inserted 16x | never inserted: mean exposure, bits (count) |",
              "|---|---|---|---|---|---|"]
    for m, mine in by.items():
        if mine:
            for view, label in (("final", "final target"), ("base", "the pretrained base alone (no client's update)"),
                                ("views", "server's view of the canary's client"),
                                ("secure", "under secure aggregation (the round's sum)")):
                if view == "final" or any(r.get(view) for r in mine):
                    lines.append(f"| {m} | {label} | " + " | ".join(leak_cells(mine, view)) + " |")
    lines += ["", f"## Exposure (bits), skew-normal extrapolation (capped at {SPACE_BITS:.1f})", "",
              "The candidates' scores fitted by a skew-normal, the canary's lower tail read off the fit (Carlini et "
              "al.'s extrapolation beyond the sample; it assumes the tail keeps the fitted shape).", "",
              "| method | view | inserted 1x | inserted 4x | inserted 16x | never inserted |", "|---|---|---|---|---|---|"]
    for m, mine in by.items():
        if mine:
            lines.append(f"| {m} | final target | " + " | ".join(cells(mine, "final", "fit")) + " |")
            if any("base" in r for r in mine):
                lines.append(f"| {m} | the pretrained base alone | " + " | ".join(cells(mine, "base", "fit")) + " |")
            lines.append(f"| {m} | server's view | " + " | ".join(cells(mine, "views", "fit")) + " |")
            if any(r.get("secure") for r in mine):
                lines.append(f"| {m} | under secure aggregation | " + " | ".join(cells(mine, "secure", "fit")) + " |")
    lines += ["", "## Extraction rate", "",
              "The share of a canary client's own facts the server reads off its view (parameter methods: greedy "
              "completion of the client's fact prompts by the view's model; generative: the fact's prompt and answer "
              "verbatim in the client's samples), and the final target's recall of the same facts; per seed the mean "
              "over the three canary clients.", "",
              "| method | server's view of the client | under secure aggregation | final target | client facts (mean) "
              "| generative: secret in samples (1x / 4x / 16x / never) |", "|---|---|---|---|---|---|"]
    for m, mine in by.items():
        if not mine:
            continue
        view = [statistics.mean(v["extraction"] for v in r["views"].values()) for r in mine if r["views"]]
        summed = [statistics.mean(v["extraction"] for v in r["secure"].values()) for r in mine if r.get("secure")]
        final = [statistics.mean(r["final_extraction"].values()) for r in mine]
        facts = statistics.mean(statistics.mean(r["facts"].values()) for r in mine)
        secret = "-"
        if m == "generative":
            counts = [sum(bool(r["views"].get(str(n), {}).get("secret_in_samples")) for r in mine) for n in INSERTIONS]
            never = sum(any(v.get("never_in_samples") for v in r["views"].values()) for r in mine)
            secret = " / ".join(f"{c}/{len(mine)}" for c in [*counts, never]) + " seeds"
        lines.append(f"| {m} | {_ms(view, 3)} | {_ms(summed, 3)} | {_ms(final, 3)} | {facts:.0f} | {secret} |")
        if any("base_extraction" in r for r in mine):
            base = [statistics.mean(r["base_extraction"].values()) for r in mine if "base_extraction" in r]
            lines.append(f"| {m}: the pretrained base alone | - | - | {_ms(base, 3)} | {facts:.0f} | - |")
        kinds: dict[str, list[float]] = defaultdict(list)  # mixed: the view's kind, over every canary client
        for r in mine:
            for v in r["views"].values():
                kinds[v.get("kind", "")].append(v["extraction"])
        if len(kinds) > 1:
            for kind, values in sorted(kinds.items()):
                lines.append(f"| {m}: {kind or 'slice folded alone'}, each canary client ({len(values)}) | "
                             f"{_ms(values, 3)} | - | - | - | - |")
    lines += ["", "Reading the tables:", "",
              "- One copy is not one pass: a sampled client takes 20 local steps of 32 windows over its own windows "
              "every round it is sampled, many epochs of a small client's text, so a canary inserted once is seen "
              "many times by its client's model.",
              "- Generative's server's-view score is a trigram model of one reply's samples and top-8 probabilities "
              "(contexts of two tokens): a lower bound on what the samples reveal. The server itself trains the "
              "target on every client's samples and top-8 log-probabilities with the whole context; its final-target "
              "row is what that reads off them.",
              "- A final target's exposure depends on how recently the canary's client trained before the run ended; "
              "the canary clients' last sampled rounds per method and seed are in the JSON (`views.<insertions>.round`).",
              "- Distill's final target learns only from the family model's logits on public text: its row measures "
              "what passes through that, and the server's view (the client's own family model) is what the server "
              "holds before distilling.",
              *([] if "lora" not in a["methods"] else [
              "- LoRA's base is the target the server first trained on the public biographies (no client's people): "
              "its own row is the floor the clients' adapters start from. Ranks 8 / 16 / 32 are 1/8 to 1/2 of this "
              "64-wide model's width (on SmolLM2, 576 wide, the recipe's same ranks are 1.4 to 5.6 %): adapters of "
              "about a slice's capacity here, more than the recipe gives them on its own base."]),
              *([] if "mixed" not in a["methods"] else [
              "- A mixed federation's canary clients are phones (their view: the family model they sent) or laptops "
              "and desktops (the slice folded alone), as the seed draws them; the extraction table splits the views "
              "by kind."]),
              "", f"Runs: {len(runs)}; wall time per run {_ms([r['wall_s'] for r in runs], 0)} s.", ""]
    if payload.get("rendered_by"):
        lines += [f"Command: `{payload['rendered_by']}` (this report, re-rendered from the JSON's runs)", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    parser.add_argument("--people", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=0, help="0: the knowledge recipe's rule (one per 40 facts)")
    parser.add_argument("--candidates", type=int, default=4095, help="secrets sampled to estimate a canary's rank")
    parser.add_argument("--jobs", type=int, default=2, help="processes (1 torch thread each)")
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, 60 people, 6 rounds, 511 candidates")
    parser.add_argument("--report-only", action="store_true", help="rewrite <out>.md from <out>.json, running nothing")
    parser.add_argument("--epsilon", type=float, default=0.0,
                        help="DP-SGD on every client at this budget (noise calibrated per client); 0: none")
    parser.add_argument("--out", default="privacy")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/privacy.py", argv)
    if args.report_only:
        payload = json.loads((RESULTS / f"{args.out}.json").read_text())
        payload["rendered_by"] = facts["command"]
        write_pair(RESULTS, args.out, payload, report(payload))
        return
    if args.quick:
        args.seeds, args.people, args.rounds, args.candidates = [args.seeds[0]], 60, 6, 511
        args.out = f"{args.out}_quick"
    conf = {k: v for k, v in vars(args).items() if k not in ("out", "report_only")}
    jobs = [{"method": m, "seed": s, "args": conf} for s in args.seeds for m in args.methods]
    runs = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for job, out in zip(jobs, pool.map(run_method, jobs)):
            runs.append(out)
            print(f"{job['method']} seed {job['seed']}: 16x final {out['final']['16']['sampled']:.2f} bits, "
                  f"{out['wall_s']:.0f}s", flush=True)
    payload = {**facts, "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "args": conf, "runs": runs}
    write_pair(RESULTS, args.out, payload, report(payload))


if __name__ == "__main__":
    main()
