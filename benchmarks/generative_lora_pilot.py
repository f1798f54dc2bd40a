"""Benchmark (a diagnosis for the finetune recipe): can what the weakest devices know reach the target through text
written by a LoRA-adapted copy of the target, which those devices can hold?

In `fedfusion compare finetune` (benchmarks/results/finetune_tiers.md) the facts held by the 2 GB phones do not reach
the target better than smallest-only: both arms train the same 1/8 window on those phones. This script measures, on
the finetune recipe's own data, whether a method built on a LoRA adapter of the target (the model the plan lets a
2 GB phone train) could carry those facts instead, before such a method is built: no rounds, one device model.

Per seed: the finetune recipe's facts (its built-in generator, its population and tiers); the documents of every
client of the weakest tier (``phone-lowend``) pooled as one device's data, and their probes. Every trained arm takes
S AdamW steps at the recipe's batch and lr (constant: the recipe decays it by cosine over its rounds), S = the steps
those clients take over the recipe's run (rounds x clients per round x the tier's share of the population x local
steps):

- ``base``: SmolLM2-135M-Instruct as loaded (the recipe's ``model.pretrained``), untrained;
- ``device LoRA, lr xK``: the base with a rank-r adapter (the recipe's ``lora.ranks`` for the tier and
  ``lora.target_modules``) trained on the pooled windows (:func:`fedfusion.train.adapter.train_adapter`, the LoRA
  client's step) at K times the recipe's lr, K in :data:`LORA_LR_TIMES`;
- its samples: what that device model writes (:func:`fedfusion.fusion.generative.reply.sample_windows`, as many
  windows as generative's default ``sample_fraction`` of the pooled windows, temperature 1), scored by the share of the
  facts whose question and answer, or answer alone, occur verbatim in them;
- ``target on the samples of the device LoRA, lr xK``: the whole target (float32) trained on them for S steps (generative's server step:
  the language-model loss on the sampled windows): what generative transfer from such devices teaches it;
- ``target on the data``: the whole target trained on the pooled windows themselves for S steps: what those devices
  teach when each fine-tunes the whole target (the oracle arm's share).

Scores: recall and answer loss of the pooled clients' facts (:func:`fedfusion.data.facts.probe_metrics`, as the
run scores every probe), and the loss on the recipe's general text (what the target forgets).

    python benchmarks/generative_lora_pilot.py --seeds 0 1 [--threads 2] [--steps S] [--out generative_lora_pilot]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from fedfusion.config.recipe import load_recipe
from fedfusion.data.facts import encode_probes, probe_metrics
from fedfusion.data.population import client_windows, data_spec, data_tokenizer, facts_by_tier, tier_list
from fedfusion.data.text import encode_text, general_text, lm_windows
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.reply import sample_windows
from fedfusion.fusion.lora.inprocess import with_update
from fedfusion.models.pretrained import load_base, resolve_base
from fedfusion.train.adapter import AdapterSetting, train_adapter
from fedfusion.train.loop import evaluate_lm, train_steps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from privacy import contains  # noqa: E402
from results_files import run_facts, write_pair  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
hf_logging.disable_progress_bar()  # no "Loading weights" bar for each of the base's loads
TIER = "phone-lowend"  # the weakest tier of the finetune recipe's population
# the device adapter's lr as multiples of the recipe's (a full fine-tuning lr): LoRA is commonly trained at about ten
# times the lr of full fine-tuning, so the recipe's own lr alone could understate what the adapter learns
LORA_LR_TIMES = (1, 10)


def scores(model: PreTrainedModel, probes, general: torch.Tensor) -> dict[str, float]:
    """Recall and answer loss of the probes, and the general text's loss."""
    out = probe_metrics(model, probes)
    return {"probe_acc": out["probe_acc"], "answer_loss": out["answer_loss"],
            "general_loss": evaluate_lm(model, general)["eval_loss"]}


def trainable(model: PreTrainedModel) -> PreTrainedModel:
    """A loaded base (frozen, eval) made a whole target to train."""
    for p in model.parameters():
        p.requires_grad_(True)
    return model.train()


def run_seed(seed: int, steps: int = 0) -> dict:
    """Every arm for one seed (see the module docstring); ``steps`` > 0 replaces S (a smoke run)."""
    start = time.perf_counter()
    recipe = load_recipe("finetune", [f"seed={seed}"])
    recipe.model.pretrained = resolve_base(recipe.model.pretrained)  # the converted base's directory, as a run's check
    source, t, pop = recipe.data_source(), recipe.train, recipe.population
    spec, tiers = data_spec(source), tier_list(pop, seed)
    weak = [p for p, tier in enumerate(tiers) if tier == TIER]
    facts, groups = facts_by_tier(recipe.data, pop, seed)
    tok = data_tokenizer(spec)
    probes = [facts.probes[i] for i in groups[TIER]]
    encoded = encode_probes(tok, probes)
    windows = torch.cat([client_windows(spec, p, t.seq_len, "train") for p in weak])
    general = lm_windows(encode_text(tok, general_text(recipe.data.general_chars)), t.seq_len)
    share = len(weak) / pop.num_clients
    steps = steps or max(1, round(recipe.rounds * recipe.selection.clients_per_round * share * t.local_steps))
    common = dict(steps=steps, lr=t.lr, batch_size=t.batch_size)
    arms: dict[str, dict] = {}

    base = load_base(recipe.model.pretrained)
    arms["base"] = scores(base, encoded, general)
    lora = recipe.lora
    setting = AdapterSetting(lora.ranks[TIER], lora.alpha, tuple(lora.target_modules), lora.dropout)
    samples: dict[str, torch.Tensor] = {}
    for times in LORA_LR_TIMES:
        arm = f"device LoRA, lr x{times}"
        tick = time.perf_counter()
        factors, _ = train_adapter(base, {}, windows, setting, seed, **{**common, "lr": t.lr * times})
        arms[arm] = {"train_s": time.perf_counter() - tick}
        scale = setting.alpha / setting.rank  # the trained adapter as a global update B @ A (scale 1) on the base
        update = {k: v * scale if k.endswith(".lora_B") else v for k, v in factors.items()}
        with with_update(base, update):
            arms[arm].update(scores(base, encoded, general))
            n = math.ceil(GenerativeConfig().sample_fraction * len(windows))
            tick = time.perf_counter()
            samples[arm] = sample_windows(base, windows, n, 1.0, seed)
            arms[arm]["sample_s"] = time.perf_counter() - tick
        written = samples[arm]
        arms[arm]["samples"] = n
        arms[arm]["facts_verbatim"] = statistics.mean(
            contains(written, tok.encode(f"{p.prompt} {p.answer}", add_special_tokens=False)) for p in probes)
        arms[arm]["answers_verbatim"] = statistics.mean(
            contains(written, tok.encode(f" {p.answer}", add_special_tokens=False)) for p in probes)
    targets = {f"target on the samples of the device LoRA, lr x{times}": samples[f"device LoRA, lr x{times}"]
               for times in LORA_LR_TIMES}
    for name, data in ({**targets, "target on the data": windows}).items():
        target = trainable(load_base(recipe.model.pretrained))
        tick = time.perf_counter()
        train_steps(target, data, seed=seed, **common)
        arms[name] = {"train_s": time.perf_counter() - tick, **scores(target.eval(), encoded, general)}
        del target
    return {"seed": seed, "weak_clients": weak, "facts": len(probes), "windows": len(windows), "steps": steps,
            "arms": arms, "wall_s": time.perf_counter() - start}


def report(payload: dict) -> str:
    runs = payload["runs"]
    names = [n for n in runs[0]["arms"]]
    lines = ["# Can the weakest devices' facts reach the target through a LoRA device model's samples?", "",
             f"Machine: {payload['machine']}; torch {payload['torch']}; {payload['threads']} threads; load before "
             f"{payload['load_before']}.", "",
             "The finetune recipe's data and population; the facts of its 2 GB phones (`phone-lowend`), their "
             "documents pooled as one device's; every trained arm S AdamW steps at the recipe's batch (4 x 32 "
             "tokens) and constant lr (3e-4; the device adapters also at ten times it), S the steps those phones "
             "take over the recipe's run. See the script's docstring for each arm.", "",
             "| seed | phones | their facts | windows | S |", "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['seed']} | {len(r['weak_clients'])} | {r['facts']} | {r['windows']} | {r['steps']} |")
    lines += ["", "| arm | seed | recall of the phones' facts | answer loss | general-text loss | train s |",
              "|---|---|---|---|---|---|"]
    for name in names:
        for r in runs:
            a = r["arms"][name]
            seconds = f"{a['train_s']:.0f}" if "train_s" in a else "-"
            lines.append(f"| {name} | {r['seed']} | {a['probe_acc']:.4f} | {a['answer_loss']:.3f} | "
                         f"{a['general_loss']:.3f} | {seconds} |")
    lines += ["", "What each device model writes (its samples: as many windows as generative's default share of the "
              "pooled windows, temperature 1). The documents state each fact in a sentence and the probes ask it as a "
              "question, so a probe's question never occurs in a document: the question-and-answer column can only "
              "be 0 here. The answers column counts answers that occur anywhere in the samples: an upper bound on "
              "the facts they carry (a year or a city can turn up beside another person).", "",
              "| device model | seed | samples | facts whose question and answer occur verbatim | answers alone | "
              "sampling s |", "|---|---|---|---|---|---|"]
    for name in names:
        for r in runs:
            a = r["arms"][name]
            if "samples" in a:
                lines.append(f"| {name} | {r['seed']} | {a['samples']} | {a['facts_verbatim']:.3f} | "
                             f"{a['answers_verbatim']:.3f} | {a['sample_s']:.0f} |")
    walls = ", ".join(f"{r['wall_s']:.0f}" for r in runs)
    lines += ["", f"Wall s per seed: {walls}.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="steps of every trained arm; 0: S (see above)")
    parser.add_argument("--out", default="generative_lora_pilot")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/generative_lora_pilot.py", argv)
    torch.set_num_threads(args.threads)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.steps))
        print(f"seed {seed}: " + ", ".join(f"{k} {v['probe_acc']:.3f}" for k, v in runs[-1]["arms"].items()),
              flush=True)
        payload = {**facts, "machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "threads": args.threads,
                   "runs": runs}
        write_pair(RESULTS, args.out, payload, report(payload), quiet=True)  # after every seed: a cut run keeps them
    print(report(payload))


if __name__ == "__main__":
    main()
