"""Benchmark: ``fedfusion compare`` of a recipe at a budget too large for the CPU, on an accelerator, in process.

``fedfusion compare RECIPE`` runs the recipe, its smallest-only arm and its oracle arm through Flower's simulation,
one run after another; on 2 CPU cores the finetune recipe (SmolLM2-135M) takes 6-10 minutes a run at 8 rounds of 4
clients x 8 steps of 4 x 32 tokens, so a budget where the arms part clearly cannot be run there. This script plans
the same comparison (:func:`fedfusion.run.compare.plan`: the same arms, overrides, resolved recipes and budget check)
and runs every (arm, seed) with the library's in-process driver (:func:`fedfusion.fusion.inprocess.run_rounds`) over
the recipe's own fusion methods (:func:`fedfusion.run.federation.build_methods`) and scoring
(:func:`fedfusion.run.targets.lm_target`), each client training on ``--device`` as the client role does
(:class:`fedfusion.fusion.inprocess.SliceClients`), several runs at once (``--jobs``). Each run directory holds what
``fedfusion compare`` reads of a run (``recipe.yaml``, ``metrics.jsonl``, ``summary.json``), so the report is
compare's own (:func:`fedfusion.run.compare.write_report`): per-seed finals, span, gap closure, noise, still rising,
per-tier closure and the curves.

What differs from ``fedfusion compare``: no Flower messages, faults, ledgers or energy; the clients of a round train
one after another; the sampling is the driver's seeded uniform draw (the same for every arm of a seed), not the
strategy's selector. Width slicing only (slices and full-forward windows, not the ``ordered`` or ``owned`` policies),
with the default selection, availability, faults and privacy and no activation checkpointing: anything else is refused,
naming the key. A run directory made by ``fedfusion run`` is never taken for one of this script's, nor the reverse.

    python benchmarks/cuda_finetune.py finetune fusion.auto_widths=true rounds=12 train.local_steps=16 --seeds 0 1 2 \
        --device cuda --jobs 9
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch
from fedfusion.strategies.fusion import scored_round

from fedfusion.config.methods import SUBMODEL
from fedfusion.config.recipe import Recipe
from fedfusion.config.sections import SelectionConfig
from fedfusion.data.population import client_windows, data_spec, tier_list
from fedfusion.fusion.inprocess import SliceClients, SubModelRun, run_rounds
from fedfusion.run.compare import Comparison, plan, state, write_report
from fedfusion.run.federation import build_methods, facts_summary
from fedfusion.run.quiet import silence_expected_noise
from fedfusion.run.run_dir import RunDir
from fedfusion.run.targets import lm_target

RESULTS = Path(__file__).resolve().parent / "results"
DRIVER = "in process (benchmarks/cuda_finetune.py)"  # summary.json's "driver": a run this script made
# the selection keys the driver follows (clients_per_round) or that change nothing without messages (timeout_s)
SELECTION_READ = ("clients_per_round", "timeout_s")


def run_inprocess(recipe: Recipe, run_dir: Path, device: str, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """One (arm, seed): the recipe's fusion methods through the in-process driver, clients on ``device``, the target
    scored on ``device`` at the recipe's evaluation rounds (round 0, every ``train.eval_every``-th, the last); writes
    the run directory and returns its summary."""
    start = time.perf_counter()
    run = RunDir(run_dir, recipe)
    t = recipe.train
    target = lm_target(recipe)
    initial = target.initial()  # the server's state stays on the CPU, as the strategy's does
    methods = build_methods(recipe, target)  # from the target's CPU state, as the strategy builds them
    target.model.to(device)
    spec = data_spec(recipe.data_source())
    tiers = tier_list(recipe.population, recipe.seed)
    windows = [client_windows(spec, p, t.seq_len, "train") for p in range(len(tiers))]
    settings = SubModelRun(  # the driver's and client role's settings: the methods are the recipe's own
        target.model.config, windows, [], rounds=recipe.rounds, per_round=recipe.selection.clients_per_round,
        steps=t.local_steps, lr=t.lr, batch_size=t.batch_size, seed=recipe.seed, weight_decay=t.weight_decay,
        optimizer=t.optimizer, lr_schedule=t.lr_schedule, lr_final=t.lr_final, max_epochs=t.max_epochs,
        device=device)
    rows: list[dict[str, Any]] = []

    def evaluate(state: dict[str, torch.Tensor] | None, rnd: int) -> dict[str, float] | None:
        if not scored_round(rnd, recipe.rounds, t.eval_every):
            return None
        if state is not None:
            target.model.load_state_dict(state)
        tick = time.perf_counter()
        row = {"round": rnd, **target.evaluate(), "eval_s": time.perf_counter() - tick,
               "elapsed_s": time.perf_counter() - start}
        run.log_round(row)
        rows.append(row)
        echo(f"  {run_dir.name} round {rnd}: {row.get('probe_acc', row['eval_loss']):.4f} ({row['elapsed_s']:.0f} s)")
        return row

    evaluate(None, 0)
    _, stats = run_rounds(methods, tiers, initial, SliceClients(settings), settings, evaluate,
                          weighting=recipe.fusion.weighting)
    summary = {"status": "ok", "name": recipe.name, "rounds": recipe.rounds,
               "facts": facts_summary(recipe, rows) if recipe.data.source == "facts" else {},
               "target_params": target.params, "wall_s": time.perf_counter() - start, "client_s": stats.client_s,
               "server_s": stats.server_s, "client_rounds": stats.client_rounds, "device": device_name(device),
               "driver": DRIVER}
    run.write_summary(summary)
    return summary


def driver_problems(recipe: Recipe) -> list[str]:
    """What of ``recipe`` the in-process driver would not do as ``fedfusion run`` does (empty: nothing)."""
    default = Recipe()
    problems = []
    if recipe.fusion.method != SUBMODEL:
        problems.append(f"fusion.method={recipe.fusion.method} (width slicing only)")
    elif recipe.fusion.policy in ("ordered", "owned"):
        problems.append(f"fusion.policy={recipe.fusion.policy} (the driver's clients train neither FjORD's ordered loss "
                        "nor windows owned across the whole population)")
    selection = {k: v for k, v in vars(recipe.selection).items() if k not in SELECTION_READ}
    if selection != {k: v for k, v in vars(SelectionConfig()).items() if k not in SELECTION_READ}:
        problems.append("selection.* beyond clients_per_round differs from the defaults (the driver draws "
                        "clients_per_round clients uniformly, all of them reply)")
    for section in ("availability", "faults", "privacy"):
        if getattr(recipe, section) != getattr(default, section):
            problems.append(f"{section}.* differs from the defaults (the driver has no {section})")
    if recipe.train.checkpoint:
        problems.append("train.checkpoint=true (the driver trains without activation checkpointing)")
    return problems


def device_name(device: str) -> str:
    """The accelerator's name (or the CPU's architecture)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} CPU"


def job(recipe: Recipe, run_dir: str, device: str, threads: int | None) -> tuple[str, str]:
    """One (arm, seed), in a worker (``threads``: its torch threads) or in this process (None: as they are):
    ('ok', '') or ('failed', the error); a failed run's summary.json says why."""
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        silence_expected_noise()
        run_inprocess(recipe, Path(run_dir), device, echo=lambda line: print(line, flush=True))
        return "ok", ""
    except Exception as exc:  # one arm's failure is reported; the others go on
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        if (Path(run_dir) / "recipe.yaml").is_file():
            RunDir(Path(run_dir), recipe, fresh=False).write_summary({"status": "failed", "error": repr(exc),
                                                                      "driver": DRIVER})
        return "failed", repr(exc)


def finished(c: Comparison, arm: str, seed: int) -> bool:
    """Whether (arm, seed) is a finished run of this comparison made by this script: compare's :func:`state` (which
    raises for a directory of another recipe), and a ``fedfusion run`` directory refused (FileExistsError)."""
    run = c.run_dir(arm, seed)
    what, path = state(run, c.recipes[arm, seed]), run / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        summary = {}
    if not summary and what != "resume":  # nothing yet, or cut before its summary: this script runs it again
        return False
    if summary.get("driver") != DRIVER:
        raise FileExistsError(f"{run} holds a run this script did not make (fedfusion run's?); choose another --work")
    return summary.get("status") == "ok"


def run_devices(c: Comparison) -> str:
    """The devices the comparison's finished runs trained on, as their summaries record them."""
    names = sorted({json.loads((c.run_dir(a, s) / "summary.json").read_text()).get("device", "?")
                    for a in c.arms for s in c.seeds if (c.run_dir(a, s) / "summary.json").is_file()})
    return ", ".join(names) or "none"


def in_process(markdown: str, stem: str, devices: str) -> str:
    """Compare's report as this script's: its runs are in-process runs on ``devices`` (not ``fedfusion run``), and
    its figure is named after ``stem``."""
    return (markdown.replace("](compare.png)", f"]({stem}.png)")
            .replace("Each (arm, seed) is `fedfusion run` in",
                     "Each (arm, seed) ran in process (this script: the recipe's own fusion methods through "
                     f"`fedfusion.fusion.inprocess.run_rounds`, clients and scoring on {devices}) in"))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("recipe", help="a recipe name or file, as fedfusion compare takes it")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe, for every arm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--device", default="cuda", help="where the clients train and the target is scored")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, each in its own process; 0: one after another in this process")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each worker (--jobs >= 1)")
    parser.add_argument("--work", default="runs/cuda-finetune", help="the comparison's directory (its run dirs)")
    parser.add_argument("--results", default=str(RESULTS), help="where the report files are copied")
    parser.add_argument("--stem", default="cuda_finetune", help="the report files' name under --results")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the report from the runs finished in --work (after a cut run)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Plan, run what is not finished, report. 0: every (arm, seed) finished and the report is under ``--results``;
    1: some did not (the report of those that did stays in ``--work``; ``--results`` is not touched)."""
    args = build_parser().parse_args(argv)
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"]
    command = shlex.join(["python", "benchmarks/cuda_finetune.py", *given])  # the command that runs the runs
    c = plan(args.recipe, args.overrides, args.seeds, Path(args.work), command=command)
    unmodelled = sorted({problem for r in c.recipes.values() for problem in driver_problems(r)})
    if unmodelled:
        raise SystemExit(f"cuda_finetune cannot run this comparison in process: {'; '.join(unmodelled)}")
    jobs = [(arm, seed) for seed in c.seeds for arm in c.arms]
    pending = [] if args.report_only else [(a, s) for a, s in jobs if not finished(c, a, s)]
    started = time.perf_counter()
    for arm, seed in pending:  # the driver keeps no checkpoints: an unfinished run starts again
        shutil.rmtree(c.run_dir(arm, seed), ignore_errors=True)
    if pending and args.jobs <= 0:
        for arm, seed in pending:
            status, error = job(c.recipes[arm, seed], str(c.run_dir(arm, seed)), args.device, None)
            print(f"{arm} seed {seed}: {status} {error} ({time.perf_counter() - started:.0f} s)", flush=True)
    elif pending:
        context = multiprocessing.get_context("spawn")  # CUDA in workers needs fresh interpreters
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context, max_tasks_per_child=1) as pool:
            futures = {pool.submit(job, c.recipes[arm, seed], str(c.run_dir(arm, seed)), args.device, args.threads):
                       (arm, seed) for arm, seed in pending}
            for future in as_completed(futures):
                arm, seed = futures[future]
                try:
                    status, error = future.result()
                except BrokenProcessPool as exc:  # a worker killed (out of memory, a crashed driver)
                    status, error = "failed", f"its worker died: {exc}"
                print(f"{arm} seed {seed}: {status} {error} ({time.perf_counter() - started:.0f} s)", flush=True)
    unfinished = sum(not finished(c, a, s) for a, s in jobs)
    paths = write_report(c)
    if unfinished:
        print(f"{unfinished} of {len(jobs)} runs did not finish; the partial report is {paths[0]} "
              f"({args.results} not written)", flush=True)
        return 1
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.png").unlink(missing_ok=True)  # no stale figure beside a report that has none
    for path in paths:
        if path.suffix == ".md":
            (out / f"{args.stem}.md").write_text(in_process(path.read_text(), args.stem, run_devices(c)))
        else:
            shutil.copyfile(path, out / f"{args.stem}{path.suffix}")
    print(f"wrote {', '.join(str(out / (args.stem + p.suffix)) for p in paths)}; "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
