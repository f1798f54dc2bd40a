"""The ``fedfusion`` command: run a recipe on Flower's simulation engine, plan it, report on runs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from textwrap import shorten
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedfusion.analysis.seed_paper import NAME as SEED_PAPER
from fedfusion.config.methods import SLICES, UNITS, call, method
from fedfusion.config.recipe import Recipe, builtin_recipes, load_recipe, nodes_per_client
from fedfusion.config.sections import RecipeError
from fedfusion.run.arms import ARM_NAMES
from fedfusion.run.check import check_recipe
from fedfusion.run.signals import EXIT_INTERRUPTED, Terminated, sigterm_as_interrupt

# soft_wrap: a line is never broken at the terminal's (or, off a terminal, rich's 80-column) width, so every
# message stays one line that grep finds
console = Console(soft_wrap=True)


class _DropDeprecation(logging.Filter):
    """Hide Flower's notice that its Python simulation entry point is deprecated (we chose it on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is deprecated" not in record.getMessage()


def _checked(ref: str, overrides: list[str]) -> Recipe:
    """The recipe, validated and checked (:func:`fedfusion.run.check.check_recipe`); says how many rounds a recipe
    with ``rounds: 0`` got from its facts."""
    recipe = load_recipe(ref, overrides)
    from_facts, chosen = recipe.rounds == 0, recipe.units.micro_batches == 0 and recipe.fusion.method == UNITS
    check_recipe(recipe)
    if from_facts:
        console.print(f"rounds: {recipe.rounds} (rounds: 0 gives one round per data.facts_per_round="
                      f"{recipe.data.facts_per_round:g} facts; set rounds=N for another budget)", highlight=False)
    if chosen:
        console.print(f"units.micro_batches: {recipe.units.micro_batches} (0: the count the timeline predicts keeps "
                      "the busiest link >= 70 % busy without a slower step; set units.micro_batches=N to fix it)",
                      highlight=False)
    return recipe


def _load_for_run(ref: str, overrides: list[str]) -> Recipe:
    """The recipe a run or deployment uses, validated and its ``fusion.auto_widths`` fitted, before anything is
    written. Torch loads only where widths are fitted, so every other recipe error comes in about a second."""
    recipe = _checked(ref, overrides)
    if recipe.fusion.auto_widths:
        from fedfusion.fusion.submodel.plan import fit_widths

        fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    if recipe.data.source == "dataset":  # load and partition it now: a missing column or a bad count stops here
        from fedfusion.data.population import partition_sizes

        partition_sizes(recipe.data_source(), recipe.fusion.method)
    return recipe


def backend_config(recipe: Recipe) -> dict[str, Any]:
    """Flower's Ray backend settings: each virtual client's resources and, with ``engine.ray_address``, the
    existing cluster to join (``ray.init(address=...)``) instead of a private one-machine Ray instance."""
    config: dict[str, Any] = {"client_resources": {"num_cpus": recipe.engine.cpus_per_client, "num_gpus": 0.0}}
    if recipe.engine.ray_address:
        config["init_args"] = {"address": recipe.engine.ray_address}
    return config


def cmd_run(args: argparse.Namespace) -> int:
    """Validate the recipe, create the run directory, run the federation with live progress."""
    from fedfusion.run.run_dir import RunDir, new_run_path

    if args.resume:
        if args.recipe or args.overrides or args.out:
            raise ValueError("--resume RUN_DIR continues that run with its own recipe.yaml; "
                             "give no recipe, overrides or --out with it")
        from fedfusion.run.checkpoint import load_checkpoint

        run = RunDir.reopen(Path(args.resume))
        if run.finished:
            console.print(f"{run.path} already finished ({run.recipe.rounds} rounds); nothing to resume, "
                          "nothing changed", highlight=False, soft_wrap=True)
            return 0
        recipe, done = run.recipe, load_checkpoint(run.path).round
    elif args.recipe:
        recipe = _load_for_run(args.recipe, args.overrides)
        run, done = RunDir(new_run_path(recipe, args.out), recipe), 0
    else:
        raise ValueError("fedfusion run: give a recipe (e.g. quickstart) or --resume RUN_DIR")
    # torch, Flower and the apps take seconds to import: only once the recipe is known to be good
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedfusion.client_app import app as client_app
    from fedfusion.run.federation import run_federation
    from fedfusion.run.interrupt import (
        CtrlC,
        EngineWatch,
        descendants,
        kill_ray_workers,
        reap,
        shutdown_ray,
        silence_ray,
    )
    from fedfusion.strategies.sweep import install as install_sweep

    verb = f"resuming after round {done}:" if args.resume else "running"
    central = method(recipe.fusion.method).central  # the units mode: optimizer steps, not rounds
    shape = (f"{recipe.units.steps} steps, units.offload={recipe.units.offload}" if central
             else f"{recipe.selection.clients_per_round} per round, {recipe.rounds} rounds")
    k = nodes_per_client(recipe)
    nodes = f" ({recipe.population.num_clients * k} SuperNodes: units.supernodes={k})" if k > 1 else ""
    console.print(f"[bold]fedfusion[/] {verb} {escape(recipe.name)}: {recipe.population.num_clients} clients{nodes}, "
                  f"{shape}, fusion={recipe.fusion.label(recipe.population.mix)}"
                  + (f", on the Ray cluster at {recipe.engine.ray_address}" if recipe.engine.ray_address else "")
                  + f"; writing {escape(str(run.path))}")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # we request no GPUs; silence Ray's notice
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.setLevel(logging.WARNING)
    flwr_logger.addFilter(_DropDeprecation())
    before = descendants()  # processes that are not this run's (a caller's own children stay untouched)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:

        def on_ctrl_c(signum: signal.Signals) -> None:
            silence_ray()
            why = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
            progress.console.print(f"{why}: stopping the run at a safe point (Ctrl-C to force)")

        ctrl_c = CtrlC(on_ctrl_c)
        task = progress.add_task("steps" if central else "rounds", total=recipe.units.steps if central else recipe.rounds,
                                 completed=done)

        def on_round(row: dict[str, Any]) -> None:
            if central:  # the exact mode: one row per optimizer step (fedfusion.run.units)
                loss = "" if row["train_loss"] is None else f"  train loss {row['train_loss']:.4f}"
                scored = f"  eval loss {row['eval_loss']:.3f}" if "eval_loss" in row else ""
                progress.console.print(
                    f"step {row['step']:>3}{loss}{scored}  {row['bytes_down'] / 1e6:.2f} MB down "
                    f"{row['bytes_up'] / 1e6:.2f} MB up  virtual {row['virtual_s']:.2f}s  wall {row['wall_s']:5.1f}s",
                    soft_wrap=True)
                if row["step"] > 0:
                    progress.advance(task)
                return
            scores = (f"loss {row['eval_loss']:.3f}  ppl {row['eval_ppl']:7.2f}  acc {row['eval_acc']:.3f}"
                      if "eval_loss" in row else f"{'not scored (train.eval_every)':<36}")
            progress.console.print(
                f"round {row['round']:>3}  {scores}  ok {row['clients_ok']} failed {row['clients_failed']}"
                + (f" cut {row['clients_cut']}" if row.get("clients_cut") else "") + "  "
                f"{row['wall_s']:5.1f}s", soft_wrap=True)
            if row["round"] > 0:
                progress.advance(task)

        server_app = ServerApp()

        @server_app.main()
        def _main(grid: Grid, context: Any) -> None:
            run_federation(grid, recipe, run, on_round=on_round, resume=bool(args.resume), stop=ctrl_c.stop)
            if ctrl_c.stop.is_set():  # the clients still training would hold Flower's shutdown until they finish
                flwr_logger.setLevel(logging.CRITICAL)  # their killed tasks are expected, not errors to show
                kill_ray_workers()

        install_sweep()  # the engine asks only the nodes with a message waiting (strategies/sweep.py)
        watch = EngineWatch(ctrl_c.stop)
        flwr_logger.addHandler(watch)
        try:
            with ctrl_c:
                run_simulation(
                    server_app=server_app, client_app=client_app, num_supernodes=recipe.population.num_clients * k,
                    backend_config=backend_config(recipe),
                )
        except RuntimeError:  # Flower re-raises its engine's failure once the ServerApp thread has ended
            if ctrl_c.stop.failure is None:
                raise
        finally:
            flwr_logger.removeHandler(watch)
    summary = run.read_summary() or {}
    if summary.get("status") == "interrupted":
        shutdown_ray()
        reap(before)
        after = summary["resume_after"]
        hint = (f"resume with: fedfusion run --resume {escape(str(run.path))}" if after is not None
                else "no checkpoint yet, nothing to resume: run it again")
        console.print(f"[yellow]interrupted[/] after round {summary['last_round']} of {recipe.rounds}; "
                      f"{hint}", highlight=False, soft_wrap=True)
        return EXIT_INTERRUPTED
    if summary.get("status") != "ok":
        shutdown_ray()
        reap(before)
        console.print(f"[red]run failed[/]: {escape(str(summary.get('error', '')))}; see {escape(str(run.path / 'summary.json'))}",
                      highlight=False, soft_wrap=True)
        return 1
    wrote = [name for name in ("report.md", "metrics.jsonl", "model/", "adapter/") if (run.path / name).exists()]
    console.print(f"done: {run.path} ({', '.join(wrote)})", markup=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Run the recipe, its smallest-only and its oracle arm at the same budget and seeds; write compare.md/.json/.png."""
    from shlex import join

    from fedfusion.run.compare import execute, plan

    argv = [args.recipe, *args.overrides, "--seeds", *map(str, args.seeds)]
    argv += ["--out", args.out] if args.out else []
    argv += ["--arms", *args.arms] if list(args.arms) != list(ARM_NAMES) else []
    argv += [a for spec in args.engine for a in ("--engine", spec)]
    comparison = plan(args.recipe, args.overrides, args.seeds, Path(args.out) if args.out else None, args.arms,
                      command="fedfusion compare " + join(argv), engine=args.engine)
    jobs = len(comparison.arms) * len(comparison.seeds)
    console.print(f"[bold]fedfusion compare[/] {escape(args.recipe)}: {', '.join(comparison.arms)} x seeds "
                  f"{', '.join(map(str, comparison.seeds))} ({jobs} runs); writing {escape(str(comparison.out))}")
    for name, arm in comparison.arms.items():
        console.print(f"  {name}: {arm.about}" + (f" [{' '.join(arm.overrides)}]" if arm.overrides else ""),
                      markup=False, highlight=False)
    return execute(comparison, echo=lambda line: console.print(line, markup=False, highlight=False))


PLAN_NOTE = ("s and J per round: the tier's training FLOPs and the bytes it moves, priced as the run's ledger "
             "prices them (fedfusion.devices.energy.price_work; J drawn from the wall)")


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what each tier trains and what one round of it costs (and the server's own work, where it has any)."""
    recipe = _checked(args.recipe, args.overrides)
    source = recipe.data_source()

    def part(name: str, tiers: list[str], usable: float) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """A mixable method's part of a mixed plan: its registry entry's ``mixed_plan``, given the recipe sections it
        names (the mixed view, below the run level, reads no method's section itself)."""
        return call(method(name).mixed_plan, recipe, source=source, usable=usable, tiers=tiers)

    # the method's plan view (its registry entry's ``plan``, in its folder's plan module, given the recipe sections
    # it names, the data source and, for a mixed view, ``part``): torch loads only now
    view = call(method(recipe.fusion.method).plan, recipe, source=source, part=part)
    _print_table(view.title, view.rows, view.headers, left=view.left, width=view.width)
    from fedfusion.devices.catalog import memory_note, population_catalog
    from fedfusion.devices.energy import runtime_notes

    emulated = memory_note(recipe.population)
    for note in (*((emulated,) if emulated else ()), *view.notes,
                 *runtime_notes(population_catalog(recipe.population), list(recipe.population.mix))):
        console.print(note, highlight=False, soft_wrap=True)
    if args.ways or (args.ways is None and recipe.model.pretrained and recipe.fusion.method in SLICES):
        from fedfusion.analysis.plan import ways_view

        ways = ways_view(recipe.name, recipe.fusion, recipe.train, recipe.population, recipe.model, source)
        _print_table(ways.title, ways.rows, ways.headers, left=ways.left, width=ways.width)
    if not view.per_round:
        return 0
    console.print(PLAN_NOTE, highlight=False)
    from fedfusion.data.federated import describe
    from fedfusion.data.population import partition_sizes

    console.print("\n".join(describe(partition_sizes(source, recipe.fusion.method))), highlight=False, soft_wrap=True)
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    """Print the device catalog (built-in, or the file given)."""
    from fedfusion.devices.catalog import catalog_rows, load_catalog

    headers = {"name": "tier", "memory_gb": "mem GB", "tflops": "TFLOPS", "train_w": "train W", "idle_w": "idle W",
               "battery_wh": "batt Wh", "up_mbps": "up Mb/s", "down_mbps": "down Mb/s", "embodied_kg": "kgCO2e",
               "lifetime_years": "years", "zone": "zone"}
    _print_table(f"device catalog ({args.catalog or 'built-in'}); descriptions and sources in the file",
                 catalog_rows(load_catalog(args.catalog)), headers, left=("name", "zone"), width=120)
    return 0


def _print_table(title: str, rows: list[dict[str, Any]], headers: dict[str, str], left: tuple[str, ...],
                 width: int) -> None:
    """Rows as a rich table; ``headers`` picks and renames columns (empty: every key as is). The first column (the
    tier or device name each row is about) is never cut short; a narrow console shortens the others."""
    headers = headers or {k: k for k in rows[0]}
    table = Table(title=title)
    first = next(iter(headers))
    for key, name in headers.items():
        whole = max([len(name), *(len(_cell(r[key])) for r in rows)]) if key == first else None
        table.add_column(name, justify="left" if key in left else "right", no_wrap=True, min_width=whole)
    for row in rows:
        table.add_row(*[_cell(row[k]) for k in headers])
    Console(width=max(console.width, width)).print(table)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def cmd_report(args: argparse.Namespace) -> int:
    """report.md + plots for one run, or a side-by-side comparison of several."""
    from fedfusion.analysis.report import compare_runs, write_report

    runs = [Path(p) for p in args.runs]
    if len(runs) == 1:
        path = write_report(runs[0], Path(args.out) if args.out else None)
    else:
        path = compare_runs(runs, Path(args.out or "comparison"))
    console.print(f"wrote {path}", markup=False)
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    """Write a local CA, a SuperLink certificate and SuperNode key pairs for a real deployment."""
    from fedfusion.deploy import make_deploy_files

    # the SuperLink's own SuperExec always connects through loopback, so loopback names stay in the certificate
    hosts = list(dict.fromkeys([*(args.host or []), "127.0.0.1", "localhost"]))
    files = make_deploy_files(Path(args.dir), hosts, args.nodes)
    console.print(f"CA {files.ca_cert}; SuperLink certificate {files.server_cert} + key {files.server_key}; "
                  f"{len(files.node_keys)} SuperNode keys {files.node_keys[0].parent}/node*[.pub]")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    """Run a recipe over a loopback SuperLink + SuperNodes with TLS and SuperNode authentication."""
    from fedfusion.deploy import deploy_local
    from fedfusion.run.run_dir import new_run_path

    recipe = _load_for_run(args.recipe, args.overrides)
    out = new_run_path(recipe, args.out)
    workdir = Path(args.workdir or f"{out}-deploy")
    result = deploy_local(Path.cwd(), args.recipe, args.overrides, workdir, out, args.unregistered,
                          echo=lambda line: console.print(line, highlight=False))
    console.print(result.output[-4000:], highlight=False, markup=False)
    for name in result.refused:
        console.print(f"{name}: refused by the SuperLink (its key is not registered)")
    for name in result.admitted:
        console.print(f"[red]{name}: NOT refused[/] although its key is not registered")
    ok = result.returncode == 0 and not result.admitted and (out / "summary.json").is_file()
    console.print(f"{'done' if ok else '[red]failed[/]'}: run {out}; deployment files and logs {workdir}")
    return 0 if ok else 1


def cmd_facts(args: argparse.Namespace) -> int:
    """Write a synthetic facts dataset in the documented file format (train.jsonl, probes.jsonl, public.jsonl)."""
    from fedfusion.data.facts import write_facts

    paths = write_facts(Path(args.dir), args.clients, args.people, args.seed, args.skew, public=args.public)
    console.print("wrote " + ", ".join(str(p) for p in paths.values())
                  + f"; run them with data.source=facts data.path={paths['train']} data.probes={paths['probes']} "
                  f"population.num_clients={args.clients}", highlight=False)
    return 0


def cmd_edge_cloud(args: argparse.Namespace) -> int:
    """Price a named edge-vs-cloud setting (the seed paper's) and say whether it lands in the paper's ranges."""
    from fedfusion.analysis.edge_cloud import check_cloud
    from fedfusion.analysis.seed_paper import CLOUD, markdown, results
    from fedfusion.devices.catalog import load_catalog

    catalog = load_catalog(args.catalog)
    cloud = args.cloud or CLOUD
    check_cloud(cloud, catalog)
    res = results(catalog, cloud)
    text = markdown(res)
    console.print(text, highlight=False, markup=False, soft_wrap=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"edge_cloud_{args.setting.replace('-', '_')}" + ("" if cloud == CLOUD else f"_{cloud}")
        shown = os.path.relpath(out) if not os.path.relpath(out).startswith("..") else str(out)
        command = shlex.join(["fedfusion", "edge-cloud", "--setting", args.setting, *(["--cloud", args.cloud] if args.cloud else []),
                              *(["--catalog", args.catalog] if args.catalog else []), "--out", shown])
        title, _, rest = text.partition("\n\n")  # the results' convention: the command that wrote them, below the title
        (out / f"{stem}.md").write_text(f"{title}\n\nCommand: `{command}`\n\n{rest}")
        (out / f"{stem}.json").write_text(json.dumps({"command": command, **res}, indent=1) + "\n")
        console.print(f"wrote {out / stem}.md and .json")
    return 0


EXAMPLES = (
    "fedfusion run quickstart",
    "fedfusion run rolling fusion.policy=static rounds=4 --out runs/static",
    "fedfusion plan quickstart fusion.auto_widths=true",
    "fedfusion run --resume runs/static",
    "fedfusion compare quickstart --seeds 0 1 2 --out runs/cmp-quickstart",
    "fedfusion report runs/static",
)


def epilog() -> str:
    """The help's closing text: the built-in recipes (read from the package, so a new recipe shows up) and
    example commands."""
    recipes = builtin_recipes()
    width = max(map(len, recipes), default=0)
    lines = ["built-in recipes (RECIPE may also be a YAML path):"]
    lines += [f"  {name:<{width}}  {shorten(about, 110 - width, placeholder=' ...')}".rstrip()
              for name, about in recipes.items()]
    lines += ["", "examples:", *(f"  {command}" for command in EXAMPLES), "",
              "key=value overrides set any recipe key (docs/recipes.md lists them)."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(prog="fedfusion", description=__doc__, epilog=epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe on Flower's simulation engine")
    run.add_argument("recipe", nargs="?", help="recipe file, or the name of a built-in recipe (e.g. quickstart)")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 fusion.policy=static")
    run.add_argument("--out", help="run directory (default: <output.dir>/<name>-<timestamp>)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="the recipe against its smallest-only and oracle arms, same budget and seeds",
                             description="Run the recipe, its smallest-only arm (every client trains only what the "
                             "weakest tier can train) and its oracle arm (every client trains the whole target) at the "
                             "same rounds, clients, local steps, optimizer, data and seeds; write DIR/compare.md, .json "
                             "and .png. Finished runs are kept: the same command resumes (docs/running.md).")
    compare.add_argument("recipe", help="recipe file, or the name of a built-in recipe (e.g. quickstart)")
    compare.add_argument("overrides", nargs="*", help="key=value overrides for every arm, e.g. rounds=6 data.path=F")
    compare.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds (default: 0 1 2)")
    compare.add_argument("--out", help="where the runs and the report go (default: <output.dir>/compare-<name>)")
    compare.add_argument("--arms", nargs="+", default=list(ARM_NAMES), choices=ARM_NAMES,
                         help="which arms to run (default: all three)")
    compare.add_argument("--engine", action="append", default=[], metavar="ARM:KEY=VALUE",
                         help="an engine setting for one arm only, e.g. oracle:cpus_per_client=2 (fewer whole-model "
                              "clients at once); how the simulation schedules clients, not the budget")
    compare.set_defaults(func=cmd_compare)
    plan = sub.add_parser("plan", help="show what each device tier trains and what it costs")
    plan.add_argument("recipe")
    plan.add_argument("overrides", nargs="*")
    plan.add_argument("--ways", action=argparse.BooleanOptionalAction, default=None,
                      help="also price every way of training the target on each tier (full fine-tuning, windows, "
                           "rank windows, LoRA; default: for a pretrained target)")
    plan.set_defaults(func=cmd_plan)
    devices = sub.add_parser("devices", help="list the device catalog")
    devices.add_argument("--catalog", help="a device catalog YAML (default: the built-in one)")
    devices.set_defaults(func=cmd_devices)
    certs = sub.add_parser("certs", help="write a CA, SuperLink certificate and SuperNode keys for deployment")
    certs.add_argument("dir")
    certs.add_argument("--host", action="append", help="SuperLink host name or IP (repeat); 127.0.0.1 and localhost are always included")
    certs.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs to write")
    certs.set_defaults(func=cmd_certs)
    deploy = sub.add_parser("deploy", help="run a recipe on a loopback SuperLink + SuperNodes (TLS, node auth)")
    deploy.add_argument("recipe")
    deploy.add_argument("overrides", nargs="*")
    deploy.add_argument("--out", help="run directory (default: <output.dir>/<name>-<timestamp>)")
    deploy.add_argument("--workdir", help="certificates, keys, Flower home and process logs (default: <out>-deploy)")
    deploy.add_argument("--unregistered", type=int, default=0,
                        help="also start this many SuperNodes with unregistered keys, to see them refused")
    deploy.set_defaults(func=cmd_deploy)
    facts = sub.add_parser("facts", help="write synthetic private facts (biographies + probes) in the facts file format")
    facts.add_argument("dir")
    facts.add_argument("--clients", type=int, default=16, help="clients that own the people")
    facts.add_argument("--people", type=int, default=400)
    facts.add_argument("--seed", type=int, default=0)
    facts.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of people per client (0: equal shares)")
    facts.add_argument("--public", type=int, default=0, help="people nobody owns, written to public.jsonl")
    facts.set_defaults(func=cmd_facts)
    edge = sub.add_parser("edge-cloud", help="price a named edge-vs-cloud setting (the seed paper's) from the catalog")
    edge.add_argument("--setting", choices=(SEED_PAPER,), default=SEED_PAPER,
                      help="OPT-125m, 100 steps, batch 16, seq 512 on the M2 Pro laptop and phone tiers vs one GPU")
    edge.add_argument("--cloud", help="the catalog's cloud tier to compare with (default: the setting's, cloud-a5000)")
    edge.add_argument("--catalog", help="a device catalog YAML (default: the built-in one)")
    edge.add_argument("--out", help="also write edge_cloud_<setting>.md and .json into this folder")
    edge.set_defaults(func=cmd_edge_cloud)
    report = sub.add_parser("report", help="report.md and plots for run directories")
    report.add_argument("runs", nargs="+")
    report.add_argument("--out", help="output folder (default: the run itself for one run, ./comparison for several)")
    report.set_defaults(func=cmd_report)
    from fedfusion.phone.commands import add_parsers

    add_parsers(sub)  # export-device, gateway, device
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedfusion`` console script."""
    args = parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():  # a scheduler's SIGTERM unwinds like Ctrl-C: every cleanup runs
            return args.func(args)
    except (RecipeError, FileExistsError, FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)  # not markup: `[datasets]` stays
        return 2
    except KeyboardInterrupt as exc:  # a command without its own stop (a run has one: it returns)
        console.print("terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
