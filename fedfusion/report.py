"""Reports: plots and a markdown summary of one run, or several runs side by side."""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from fedfusion.devices import load_catalog  # noqa: E402
from fedfusion.edge_cloud import edge_cloud_markdown, work_from_clients  # noqa: E402
from fedfusion.run_dir import read_jsonl  # noqa: E402

CURVES = (("eval_loss", "held-out loss (nats/char)"), ("eval_ppl", "held-out perplexity"),
          ("eval_acc", "next-character accuracy"))


def _load(run: Path) -> tuple[list[dict], dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl; is this a fedfusion run directory?")
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"status": "incomplete"}
    return read_jsonl(metrics), summary


def _label(run: Path) -> str:
    return run.resolve().name


def plot_curves(runs: list[Path], out_dir: Path) -> list[Path]:
    """One PNG per metric, every run as a line against the round number."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in CURVES:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            rows, _ = _load(run)
            ax.plot([r["round"] for r in rows], [r[key] for r in rows], marker="o", label=_label(run))
        ax.set_xlabel("round")
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
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for run in runs:
        rows, _ = _load(run)
        for ax, key in zip(axes, ("energy_j", "co2_g")):
            xs = list(accumulate(r.get(key, 0.0) for r in rows))
            ax.plot(xs, [r["eval_loss"] for r in rows], marker="o", label=_label(run))
    axes[0].set_xlabel("cumulative energy, all clients (J, priced from counted work)")
    axes[1].set_xlabel("cumulative CO2e (g, operational + embodied)")
    axes[0].set_ylabel("held-out loss")
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
    cloud = next((name for name in ("cloud-a100", "cloud-h100") if name in catalog), None)
    if cloud is None:
        return "## Edge vs cloud\n\nThe device catalog has no cloud reference (cloud-a100 or cloud-h100)."
    return edge_cloud_markdown(work_from_clients(clients), catalog=catalog, cloud=cloud)


def write_report(run: Path) -> Path:
    """report.md and plots/ for one run directory."""
    rows, summary = _load(run)
    plots = plot_curves([run], run / "plots")
    cols = ("round", "eval_loss", "eval_ppl", "eval_acc", "train_loss", "coverage", "clients_ok",
            "clients_failed", "clients_cut", "bytes_down", "bytes_up", "energy_j", "co2_g", "virtual_s", "wall_s")
    lines = [f"# Run report: {_label(run)}", ""]
    if "facts" in summary:  # federated knowledge: lead with what the target recalls
        f = summary["facts"]
        lines += [f"**The target recalls {100 * f['probe_acc']:.1f} % of all {f['clients']} clients' {f['probes']} facts** "
                  f"(best round: {100 * f['best_probe_acc']:.1f} %); a device training alone sees only its own facts, "
                  f"so the best any single device could recall alone is {100 * f['largest_client_share']:.1f} % "
                  "(the largest client's share, with perfect memory).", ""]
    lines += [f"Status: **{summary.get('status')}**", ""]
    if summary.get("status") == "ok":
        first, last = summary["initial"], summary["final"]
        lines += [
            f"Target: {summary['target_params']:,} parameters, {summary['rounds']} rounds, "
            f"{summary['wall_s']:.0f} s wall. Clients' work priced on their device profiles: "
            f"{summary['energy_j']:.1f} J ({summary['wasted_j']:.1f} J wasted on failed, rejected, dropped or cut work), "
            f"{summary['co2_g']:.4f} g CO2e, {summary['virtual_s']:.1f} s of simulated time.",
            "",
            (f"Probe answer loss {first['eval_loss']:.3f} -> **{last['eval_loss']:.3f}** nats/token; "
             f"probe accuracy {first['eval_acc']:.3f} -> **{last['eval_acc']:.3f}**." if "facts" in summary else
             f"Held-out perplexity {first['eval_ppl']:.2f} -> **{last['eval_ppl']:.2f}**; "
             f"next-character accuracy {first['eval_acc']:.3f} -> **{last['eval_acc']:.3f}**."),
            "",
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
    """Side-by-side report of several runs: overlaid curves and a table of final metrics."""
    plots = plot_curves(runs, out_dir / "plots")
    lines = ["# Comparison", "",
             "| run | status | rounds | final loss | final ppl | final acc | energy J | CO2e g | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        rows, summary = _load(run)
        last = rows[-1]
        energy, co2 = (sum(r.get(k, 0.0) for r in rows) for k in ("energy_j", "co2_g"))
        lines.append(f"| {_label(run)} | {summary.get('status')} | {last['round']} | {last['eval_loss']:.4f} | "
                     f"{last['eval_ppl']:.3f} | {last['eval_acc']:.4f} | {energy:.4g} | {co2:.4g} | "
                     f"{_fmt(summary.get('wall_s'))} |")
    lines += [""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
