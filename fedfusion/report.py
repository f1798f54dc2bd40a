"""Reports: plots and a markdown summary of one run, or several runs side by side."""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from fedfusion.devices import load_catalog  # noqa: E402
from fedfusion.edge_cloud import DEFAULT_CLOUD, check_cloud, edge_cloud_markdown, work_from_clients  # noqa: E402
from fedfusion.run_dir import read_jsonl  # noqa: E402

CURVES = (("eval_loss", "held-out loss (nats/char)"), ("eval_ppl", "held-out perplexity"),
          ("eval_acc", "next-character accuracy"))
# a knowledge run (data.source=facts, its summary has "facts") scores the same fields on its probes
FACTS_CURVES = (("eval_loss", "probe answer loss (nats/token)"), ("eval_ppl", "probe answer perplexity"),
                ("eval_acc", "probe accuracy"))
LOWER_IS_BETTER = {"eval_loss": True, "eval_ppl": True, "eval_acc": False, "probe_acc": False}


def _load(run: Path) -> tuple[list[dict], dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl; is this a fedfusion run directory?")
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"status": "incomplete"}
    return read_jsonl(metrics), summary


def _label(run: Path) -> str:
    return run.resolve().name


def _best(rows: list[dict], key: str) -> tuple[float, int] | None:
    """The best value of ``key`` over all rounds (round 0, the initial target, included) and its round;
    the earliest such round on ties; None where no row has the key."""
    scored = [r for r in rows if r.get(key) is not None]
    if not scored:
        return None
    row = (min if LOWER_IS_BETTER[key] else max)(scored, key=lambda r: r[key])
    return row[key], row["round"]


def _curve_labels(runs: list[Path]) -> tuple[tuple[str, str], ...]:
    kinds = {"facts" in _load(run)[1] for run in runs}
    if kinds == {True}:
        return FACTS_CURVES
    if kinds == {False}:
        return CURVES
    return (("eval_loss", "held-out or probe answer loss"), ("eval_ppl", "held-out or probe answer perplexity"),
            ("eval_acc", "next-character or probe accuracy"))  # runs of both kinds side by side


def plot_curves(runs: list[Path], out_dir: Path) -> list[Path]:
    """One PNG per metric, every run as a line against the round number."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in _curve_labels(runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            rows, _ = _load(run)
            ax.plot([r["round"] for r in rows], [r[key] for r in rows], marker="o", label=_label(run))
        ax.set_title(f"{title[0].upper()}{title[1:]} by round ({'higher' if key == 'eval_acc' else 'lower'} is better)",
                     fontsize=10)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(title)
        if key == "eval_ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    paths.append(_plot_cost(runs, out_dir))
    return paths


def _plot_cost(runs: list[Path], out_dir: Path) -> Path:
    """Held-out loss against cumulative energy and cumulative CO2e: what the learning cost."""
    loss = _curve_labels(runs)[0][1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for run in runs:
        rows, _ = _load(run)
        for ax, key in zip(axes, ("energy_j", "co2_g")):
            xs = list(accumulate(r.get(key, 0.0) for r in rows))
            ax.plot(xs, [r["eval_loss"] for r in rows], marker="o", label=_label(run))
    axes[0].set_xlabel("cumulative energy, all clients (J, priced from counted work)")
    axes[1].set_xlabel("cumulative CO2e (g, operational + embodied)")
    axes[0].set_ylabel(loss)
    name = loss.split(" (")[0]
    axes[0].set_title(f"{name[0].upper()}{name[1:]} against cumulative energy", fontsize=10)
    axes[1].set_title(f"{name[0].upper()}{name[1:]} against cumulative CO2e", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "loss_vs_cost.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _edge_cloud_section(run: Path) -> str:
    """The run's client work priced on a cloud GPU instead (fedfusion.edge_cloud), or why it cannot be."""
    clients = read_jsonl(run / "clients.jsonl") if (run / "clients.jsonl").is_file() else []
    if not clients:
        return "## Edge vs cloud\n\nNo client work was recorded."
    recipe = OmegaConf.load(run / "recipe.yaml") if (run / "recipe.yaml").is_file() else {}
    catalog = load_catalog(OmegaConf.select(recipe, "population.catalog", default=None) if recipe else None)
    cloud = OmegaConf.select(recipe, "report.cloud", default=DEFAULT_CLOUD) if recipe else DEFAULT_CLOUD
    try:
        check_cloud(cloud, catalog)
    except ValueError as exc:
        return f"## Edge vs cloud\n\nNo cloud reference to price the work on: report.{exc}."
    return edge_cloud_markdown(work_from_clients(clients), catalog=catalog, cloud=cloud)


def _headline(rows: list[dict], summary: dict) -> list[str]:
    """Initial -> final, and the best round, of the run's two headline metrics: the last round is often
    not the best, and a report that shows only the last one misleads."""
    first, last = summary["initial"], summary["final"]
    final_round = rows[-1]["round"] if rows else summary.get("rounds")
    if "facts" in summary:
        metrics = (("eval_loss", "Probe answer loss", ".3f", " nats/token"), ("eval_acc", "probe accuracy", ".3f", ""))
    else:
        metrics = (("eval_ppl", "Held-out perplexity", ".2f", ""), ("eval_acc", "next-character accuracy", ".3f", ""))
    parts, worse = [], []
    for key, name, fmt, unit in metrics:
        best = _best(rows, key) or (last[key], final_round)
        parts.append(f"{name} {first[key]:{fmt}} -> final **{last[key]:{fmt}}**{unit} (round {final_round}), "
                     f"best **{best[0]:{fmt}}**{unit} (round {best[1]})")
        if best[1] != final_round and best[0] != last[key]:
            worse.append(f"{name.lower()} was best at round {best[1]}")
    lines = ["; ".join(parts) + ".", ""]
    if worse:
        lines += [f"The final round is not the best one ({', '.join(worse)}): the final figures, and any saved "
                  "model, are those of the final round.", ""]
    return lines


def write_report(run: Path) -> Path:
    """report.md and plots/ for one run directory."""
    rows, summary = _load(run)
    plots = plot_curves([run], run / "plots")
    cols = ("round", "eval_loss", "eval_ppl", "eval_acc", "train_loss", "coverage", "clients_ok",
            "clients_failed", "clients_cut", "bytes_down", "bytes_up", "energy_j", "co2_g", "virtual_s", "wall_s")
    lines = [f"# Run report: {_label(run)}", ""]
    if "facts" in summary:  # federated knowledge: lead with what the target recalls
        f = summary["facts"]
        best_round = _best(rows, "probe_acc")
        at = f" at round {best_round[1]}" if best_round else ""
        lines += [f"**The target recalls {100 * f['probe_acc']:.1f} % of all {f['clients']} clients' {f['probes']} facts** "
                  f"after the final round (best: {100 * f['best_probe_acc']:.1f} %{at}); a device training alone sees "
                  "only its own facts, "
                  f"so the best any single device could recall alone is {100 * f['largest_client_share']:.1f} % "
                  "(the largest client's share, with perfect memory).", ""]
    lines += [f"Status: **{summary.get('status')}**", ""]
    if summary.get("status") == "ok":
        lines += [
            f"Target: {summary['target_params']:,} parameters, {summary['rounds']} rounds, "
            f"{summary['wall_s']:.0f} s wall. Clients' work priced on their device profiles: "
            f"{summary['energy_j']:.1f} J ({summary['wasted_j']:.1f} J wasted on failed, rejected, dropped or cut work), "
            f"{summary['co2_g']:.4f} g CO2e, {summary['virtual_s']:.1f} s of simulated time.",
            "",
            *_headline(rows, summary),
            ("Greedy answers of the final target to a few probes:" if "facts" in summary
             else "Sample from the final target (top-k 10):"),
            "",
            "```",
            summary.get("sample", ""),
            "```",
            "",
        ]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    lines += [""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    lines += [_edge_cloud_section(run), ""]
    path = run / "report.md"
    path.write_text("\n".join(lines))
    return path


def compare_runs(runs: list[Path], out_dir: Path) -> Path:
    """Side-by-side report of several runs: overlaid curves and a table of final and best metrics."""
    plots = plot_curves(runs, out_dir / "plots")
    loaded = [(run, *_load(run)) for run in runs]
    lines = ["# Comparison", "",
             "**final** is the last round's evaluation (what the run ends with); **best** is the best round's "
             "(lowest loss and perplexity, highest accuracy, round 0 = the initial target included), with that "
             "round in parentheses. Where they differ, the run ended worse than it had been.", ""]
    facts = [_label(run) for run, _, summary in loaded if "facts" in summary]
    if facts:
        lines += [f"Knowledge runs ({', '.join(facts)}) score their probes: loss is the probe answer loss "
                  "(nats/token), acc the probe accuracy.", ""]
    lines += ["| run | status | rounds | final loss | final ppl | final acc | best loss (round) | best ppl (round) | "
              "best acc (round) | energy J | CO2e g | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, rows, summary in loaded:
        last = rows[-1]
        energy, co2 = (sum(r.get(k, 0.0) for r in rows) for k in ("energy_j", "co2_g"))
        best = {}
        for key, fmt in (("eval_loss", ".4f"), ("eval_ppl", ".3f"), ("eval_acc", ".4f")):
            value = _best(rows, key)
            best[key] = f"{value[0]:{fmt}} ({value[1]})" if value else ""
        lines.append(f"| {_label(run)} | {summary.get('status')} | {last['round']} | {last['eval_loss']:.4f} | "
                     f"{last['eval_ppl']:.3f} | {last['eval_acc']:.4f} | {best['eval_loss']} | {best['eval_ppl']} | "
                     f"{best['eval_acc']} | {energy:.4g} | {co2:.4g} | {_fmt(summary.get('wall_s'))} |")
    lines += [""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
