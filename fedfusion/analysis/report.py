"""Reports: plots and a markdown summary of one run, or several runs side by side."""

from __future__ import annotations

import json
from collections import Counter
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import OmegaConf

from fedfusion.analysis.edge_cloud import check_cloud, edge_cloud_markdown, work_from_clients
from fedfusion.config.choices import DEFAULT_CLOUD
from fedfusion.config.methods import BY_NAME, CENTRAL, MIXED, SERVER_WORK, hook
from fedfusion.data.federated import describe, read_partition_sizes
from fedfusion.data.tier_keys import grouped
from fedfusion.devices.catalog import load_catalog

# What eval_loss, eval_ppl and eval_acc measure, by how the target is scored: fedfusion.run.targets picks one for
# the run and summary.json records it as metric_names
CHAR_METRICS = {"eval_loss": "held-out loss (nats/char)", "eval_ppl": "held-out perplexity",
                "eval_acc": "next-character accuracy"}
TOKEN_METRICS = {"eval_loss": "held-out loss (nats/token)", "eval_ppl": "held-out perplexity (per token)",
                 "eval_acc": "next-token accuracy"}
FACTS_METRICS = {"eval_loss": "probe answer loss (nats/token)", "eval_ppl": "probe answer perplexity",
                 "eval_acc": "probe accuracy"}
RESPONSE_METRICS = {"eval_loss": "held-out response loss (nats/token)", "eval_ppl": "held-out response perplexity",
                    "eval_acc": "next-token accuracy (response tokens)"}
ALL_TIERS = "*"  # holder_scores' entry for every tier's facts together
LOWER_IS_BETTER = {"eval_loss": True, "eval_ppl": True, "eval_acc": False, "probe_acc": False}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a run's .jsonl file (metrics, clients, nodes)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend, imported by the first plot: the server, the CLI and the
    tests import this module without drawing (pyplot is a few hundred ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    """The best value of ``key`` over all scored rounds (round 0, the initial target, included; with
    ``train.eval_every`` > 1 a round between the scored ones has no score and cannot be best) and its round;
    the earliest such round on ties; None where no row has the key."""
    scored = [r for r in rows if r.get(key) is not None]
    if not scored:
        return None
    row = (min if LOWER_IS_BETTER[key] else max)(scored, key=lambda r: r[key])
    return row[key], row["round"]


def _last_scored(rows: list[dict]) -> dict:
    """The last row central evaluation scored (a finished run's last round always is; ``train.eval_every``)."""
    return next((r for r in reversed(rows) if r.get("eval_loss") is not None), rows[-1])


def _unscored_note(rows: list[dict]) -> list[str]:
    """A line saying which rounds central evaluation scored, where it skipped some (``train.eval_every``)."""
    scored = [r["round"] for r in rows if r.get("eval_loss") is not None]
    if len(scored) == len(rows):
        return []
    return [f"Central evaluation scored rounds {', '.join(map(str, scored))} of {rows[-1]['round']} "
            "(`train.eval_every`): best is the best of those, final the last one's.", ""]


def still_rising(curve: list[float]) -> tuple[int, float] | None:
    """(k, gain) when a higher-is-better curve still rises clearly over its last k evaluations (k: a fifth of
    them, at least 3), else None. The gain is the least-squares slope over those k steps times k, so one noisy
    evaluation neither makes nor hides it; clearly: at least 0.01 and 5 % of the curve's whole rise. A run still
    rising there was cut short by its budget, and its final figure understates what the method reaches."""
    k = max(3, (len(curve) - 1) // 5)
    tail = curve[-(k + 1):]
    if len(tail) < k + 1:
        return None
    mean_x, mean_y = k / 2, sum(tail) / len(tail)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(tail)) / sum((x - mean_x) ** 2 for x in range(k + 1))
    return (k, slope * k) if slope * k >= max(0.01, 0.05 * (max(curve) - curve[0])) else None


def forgetting(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(first, last) general-text loss of a run's rows, nats/token: what fine-tuning a pretrained target made it
    forget of text it already modelled (``data.general_chars``); None for a run that does not score it."""
    general = [float(r["general_loss"]) for r in rows if r.get("general_loss") is not None]
    return (general[0], general[-1]) if len(general) > 1 else None


def forgetting_text(general: tuple[float, float]) -> str:
    """:func:`forgetting`'s pair as the run report and ``fedfusion compare`` write it: first -> last and the change."""
    first, last = general
    return f"{first:.3f} -> {last:.3f} nats/token ({100 * (last / first - 1):+.1f} %)"


def holder_scores(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last scored round's recall and answer loss of the facts per device tier of the client holding them
    (``probe_acc/<tier>``), and of every fact under ``*``; empty for a run that does not score them by tier."""
    last = next((r for r in reversed(rows) if r.get("probe_acc") is not None), None)
    acc = grouped(last, "probe_acc") if last is not None else {}
    if last is None or not acc:
        return {}
    loss = grouped(last, "answer_loss")
    return {**{tier: {"probe_acc": value, "answer_loss": loss.get(tier)} for tier, value in acc.items()},
            ALL_TIERS: {"probe_acc": last["probe_acc"], "answer_loss": last.get("answer_loss")}}


def holder_recall(rows: list[dict[str, Any]], counts: dict[str, int] | None = None) -> str | None:
    """:func:`holder_scores` as the run report writes it; None for a run that does not score the facts by tier."""
    scores = {t: v for t, v in holder_scores(rows).items() if t != ALL_TIERS}
    if not scores:
        return None
    return ", ".join(f"{tier} {100 * v['probe_acc']:.1f} %"
                     + (f" of {counts[tier]}" if counts and tier in counts else "")
                     + (f" (answer loss {v['answer_loss']:.3f})" if v["answer_loss"] is not None else "")
                     for tier, v in scores.items())


def _metric_names(summary: dict) -> dict[str, str]:
    """What the run's eval fields measure, as its summary records them; a run written before summaries did:
    the probe metrics for a knowledge run, else the character-level ones."""
    return summary.get("metric_names") or (FACTS_METRICS if "facts" in summary else CHAR_METRICS)


def _curve_labels(runs: list[Path]) -> tuple[tuple[str, str], ...]:
    """(metric, label) of each curve; runs that measure different things side by side name each of them."""
    names = [_metric_names(_load(run)[1]) for run in runs]
    return tuple((key, " or ".join(dict.fromkeys(n[key] for n in names))) for key in ("eval_loss", "eval_ppl", "eval_acc"))


def plot_curves(runs: list[Path], out_dir: Path) -> list[Path]:
    """One PNG per metric, every run as a line against the round number."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in _curve_labels(runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            rows, _ = _load(run)
            scored = [r for r in rows if r.get(key) is not None]  # train.eval_every: the rounds scored
            ax.plot([r["round"] for r in scored], [r[key] for r in scored], marker="o", label=_label(run))
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
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for run in runs:
        rows, _ = _load(run)
        for ax, key in zip(axes, ("energy_j", "co2_g")):
            xs = list(accumulate(r.get(key, 0.0) for r in rows))  # every round costs; only scored ones have a loss
            points = [(x, r["eval_loss"]) for x, r in zip(xs, rows) if r.get("eval_loss") is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=_label(run))
    server = any(r.get("server_energy_j") for run in runs for r in _load(run)[0])
    axes[0].set_xlabel(f"cumulative energy, all clients{' and the server' if server else ''} "
                       "(J, priced from counted work)")
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


def _data_section(run: Path, out: Path) -> list[str]:
    """Examples per client (a histogram) and, where the data has labels, each client's label mix (the plot in
    ``out``/plots)."""
    sizes = read_partition_sizes(run)
    if sizes is None:
        return []
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if sizes.labels else 1, figsize=(11 if sizes.labels else 6, 4), squeeze=False)
    axes[0, 0].hist(sizes.examples, bins=min(20, max(1, len(set(sizes.examples)))), color="tab:blue")
    axes[0, 0].set_xlabel(f"{sizes.unit} per client")
    axes[0, 0].set_ylabel("clients")
    axes[0, 0].set_title(f"Data per client ({len(sizes.examples)} clients)", fontsize=10)
    if sizes.labels:
        labels = sorted({label for counts in sizes.labels for label in counts})
        bottom = [0] * len(sizes.labels)
        for label in labels:
            heights = [counts.get(label, 0) for counts in sizes.labels]
            axes[0, 1].bar(range(len(heights)), heights, bottom=bottom, label=label if len(labels) <= 12 else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
        axes[0, 1].set_xlabel("client")
        axes[0, 1].set_ylabel(sizes.unit)
        axes[0, 1].set_title(f"Each client's {sizes.label} mix ({len(labels)} labels)", fontsize=10)
        if len(labels) <= 12:
            axes[0, 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plots" / "partitions.png", dpi=110)
    plt.close(fig)
    return ["## Data", "", *(f"    {line}" for line in describe(sizes)), "", "![partitions](plots/partitions.png)", ""]


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _edge_cloud_section(recipe: Any, clients: list[dict]) -> str:
    """The run's client work priced on a cloud GPU instead (fedfusion.analysis.edge_cloud), or why it cannot be."""
    if not clients:
        return "## Edge vs cloud\n\nNo client work was recorded."
    catalog = load_catalog(OmegaConf.select(recipe, "population.catalog", default=None))
    cloud = OmegaConf.select(recipe, "report.cloud", default=DEFAULT_CLOUD)
    try:
        check_cloud(cloud, catalog)
    except ValueError as exc:
        return f"## Edge vs cloud\n\nNo cloud reference to price the work on: report.{exc}."
    work = work_from_clients(clients)
    if not any(w.useful > 0 for w in work):
        return ("## Edge vs cloud\n\nNo client work reached the model (every reply failed, was rejected or cut): "
                "the cloud would have trained nothing, so there is nothing to compare.")
    return edge_cloud_markdown(work, catalog=catalog, cloud=cloud)


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _recipe(run: Path) -> Any:
    """The run's resolved recipe as an OmegaConf node (an empty one where the run directory has none)."""
    return OmegaConf.load(run / "recipe.yaml") if (run / "recipe.yaml").is_file() else OmegaConf.create({})


def _server_method(recipe: Any) -> str:
    """The method whose server work the run prices (distill before generative in a mixed federation), else ''."""
    method = OmegaConf.select(recipe, "fusion.method", default="")
    used = set((OmegaConf.select(recipe, "fusion.tiers", default=None) or {}).values()) if method == MIXED else {method}
    return next((m for m in SERVER_WORK if m in used), "")


def _server_device(recipe: Any) -> str:
    """The catalog tier the server's own work is priced on (distillation and generative fusion), else ''."""
    method = _server_method(recipe)  # its recipe section holds server_device
    return OmegaConf.select(recipe, f"{BY_NAME[method].server_device}.server_device", default="") if method else ""


def _cost_line(recipe: Any, rows: list[dict], summary: dict) -> str:
    """Energy, carbon and simulated time, the clients' work apart from the server's own (distillation and
    generative fusion price the server's training too, and the run's totals include it)."""
    server_j, server_g = (sum(r.get(k) or 0.0 for r in rows) for k in ("server_energy_j", "server_co2_g"))
    clients = (f"Clients' work priced on their device profiles: {summary['energy_j'] - server_j:.1f} J "
               f"({summary['wasted_j']:.1f} J wasted on failed, rejected, dropped or cut work), "
               f"{summary['co2_g'] - server_g:.4f} g CO2e")
    if not server_j:
        return f"{clients}, {summary['virtual_s']:.1f} s of simulated time."
    work = SERVER_WORK.get(_server_method(recipe), "the server's own work")
    flops = sum(r.get("server_flops") or 0.0 for r in rows)
    return (f"{clients}. {_capital(work)}, priced on {_server_device(recipe) or 'its device profile'}: "
            f"{server_j:.1f} J ({flops:.3g} FLOPs), {server_g:.4f} g CO2e. Together {summary['energy_j']:.1f} J, "
            f"{summary['co2_g']:.4f} g CO2e, {summary['virtual_s']:.1f} s of simulated time (the server's included).")


def _work_section(recipe: Any, clients: list[dict], rows: list[dict]) -> list[str]:
    """Who did the work: per device tier what its clients trained, how often, and its priced energy; then the
    server's own training where it has any."""
    if not clients:
        return []
    lines = ["## Who did the work", "", "| who | trained | params | client rounds ok | other | energy J | CO2e g |",
             "|---|---|---|---|---|---|---|"]
    method = OmegaConf.select(recipe, "fusion.method", default="")
    for tier in dict.fromkeys(c["device"] for c in clients):
        mine = [c for c in clients if c["device"] == tier]
        trained = ", ".join(dict.fromkeys(_trained(c, method) for c in mine))
        params = ", ".join(dict.fromkeys(f"{c['params']:,}" for c in mine if c.get("params")))
        ok = sum(c["status"] == "ok" for c in mine)
        lines.append(f"| {tier} | {trained} | {params} | {ok} | {len(mine) - ok} | "
                     f"{sum(c.get('energy_j') or 0.0 for c in mine):.4g} | {sum(c.get('co2_g') or 0.0 for c in mine):.4g} |")
    server_j = sum(r.get("server_energy_j") or 0.0 for r in rows)
    if server_j:
        rounds = sum(1 for r in rows if r.get("server_flops"))
        lines.append(f"| server ({_server_device(recipe) or '?'}) | {SERVER_WORK.get(_server_method(recipe), 'its own work')} | | "
                     f"{rounds} rounds | | {server_j:.4g} | {sum(r.get('server_co2_g') or 0.0 for r in rows):.4g} |")
    note = ("params: what a client of that tier trained (priced at 6 x params x tokens); other: failed, rejected, "
            "timed-out, cut or dropped client rounds.")
    if method in BY_NAME and BY_NAME[method].report_note:
        note += hook(BY_NAME[method].report_note)
    return lines + ["", note, ""]


def _trained(client: dict, method: str) -> str:
    """What one client round trained, from its ledger row (its ``method``, or the run's fusion method)."""
    method = client.get("method") or method
    assignment = client.get("assignment") or {}
    if "family" in assignment:
        return f"family {assignment['family']}"
    if client.get("rank"):
        bits = client.get("quantize") or 0
        return f"LoRA rank {client['rank']}" + (f" on a {bits}-bit base" if bits else "")
    if client.get("width") is None:
        return "-"
    if method in BY_NAME and BY_NAME[method].trained:
        return str(hook(BY_NAME[method].trained)(client))
    return f"width {client['width']:g} slice"


def _family_section(rows: list[dict], summary: dict) -> list[str]:
    """Distillation fusion: every client family's held-out scores (per character, like the target's), final and
    best, next to the target's."""
    names = sorted({k[len("family_"):-len("_loss")] for r in rows for k in r
                    if k.startswith("family_") and k.endswith("_loss")})
    if not names:
        return []
    lines = ["## Client families", "",
             "Each family model is scored after every round on the same held-out text as the target, in nats per "
             "character whatever its tokenizer; accuracy is next-character accuracy for character-level families "
             "and next-token accuracy (in the family's own tokens) for the others.", "",
             "| model | final loss (nats/char) | final ppl | final acc | best loss (round) |", "|---|---|---|---|---|"]
    last = _last_scored(rows)
    target_best = _best(rows, "eval_loss") or (last["eval_loss"], last["round"])
    lines.append(f"| target | {last['eval_loss']:.4f} | {last['eval_ppl']:.3f} | {last['eval_acc']:.4f} "
                 f"({_metric_names(summary)['eval_acc']}) | "
                 f"{target_best[0]:.4f} ({target_best[1]}) |")
    for name in names:
        scored = [r for r in rows if r.get(f"family_{name}_loss") is not None]
        final = scored[-1]
        acc = (f"{final[f'family_{name}_acc']:.4f} (next-character accuracy)" if f"family_{name}_acc" in final else
               f"{final[f'family_{name}_token_acc']:.4f} (next-token accuracy)" if f"family_{name}_token_acc" in final else "")
        best = min(scored, key=lambda r: r[f"family_{name}_loss"])
        lines.append(f"| family {name} | {final[f'family_{name}_loss']:.4f} | {final[f'family_{name}_ppl']:.3f} | "
                     f"{acc} | {best[f'family_{name}_loss']:.4f} ({best['round']}) |")
    return lines + [""]


def _headline(rows: list[dict], summary: dict) -> list[str]:
    """Initial -> final, and the best round, of the run's two headline metrics: the last round is often
    not the best, and a report that shows only the last one misleads."""
    first, last = summary["initial"], summary["final"]
    final_round = rows[-1]["round"] if rows else summary.get("rounds")
    names = _metric_names(summary)
    if "facts" in summary:
        metrics = (("eval_loss", "Probe answer loss", ".3f", " nats/token"), ("eval_acc", names["eval_acc"], ".3f", ""))
    else:
        metrics = (("eval_ppl", _capital(names["eval_ppl"]), ".2f", ""), ("eval_acc", names["eval_acc"], ".3f", ""))
    parts, worse = [], []
    for key, name, fmt, unit in metrics:
        best = _best(rows, key) or (last[key], final_round)
        parts.append(f"{name} {first[key]:{fmt}} -> final **{last[key]:{fmt}}**{unit} (round {final_round}), "
                     f"best **{best[0]:{fmt}}**{unit} (round {best[1]})")
        if best[1] != final_round and best[0] != last[key]:
            worse.append(f"{name.lower()} was best at round {best[1]}")
    lines = ["; ".join(parts) + ".", "", *_unscored_note(rows)]
    if worse:
        lines += [f"The final round is not the best one ({', '.join(worse)}): the final figures, and any saved "
                  "model, are those of the final round.", ""]
    return lines


def _participation_section(recipe: Any, clients: list[dict], summary: dict) -> list[str]:
    """Who was selected and who took part: the selector, the availability model, dropouts, failures and cuts,
    how many of the population ever trained, and Jain's fairness of their participation (what ``clients.jsonl``
    and the summary measured)."""
    if not clients or summary.get("status") != "ok":
        return []
    selector = OmegaConf.select(recipe, "selection.method", default="random")
    population = OmegaConf.select(recipe, "population.num_clients", default=None)
    available = bool(OmegaConf.select(recipe, "availability.enabled", default=False))
    status = Counter(str(c.get("status")) for c in clients)
    trained = {c.get("partition") for c in clients if c.get("status") == "ok"}
    by_tier = Counter(str(c.get("device")) for c in clients if c.get("status") == "ok")
    lines = ["## Selection and participation", "",
             f"Selector **{selector}**; availability model **{'on' if available else 'off'}**"
             + ("" if available else " (every client always available)") + ". Over the run the server asked "
             f"{sum(status.values())} client rounds: {status.get('ok', 0)} ok, {status.get('dropped', 0)} dropped "
             f"before training (unavailable), {status.get('cut', 0)} cut by over-selection, "
             f"{sum(v for k, v in status.items() if k not in ('ok', 'dropped', 'cut'))} failed or rejected.", ""]
    jain = summary.get("participation_jain")
    if population:
        lines += [f"{len(trained)} of the population's {population} clients trained at least once"
                  + (f"; Jain's fairness of participation (1 = every client trained equally often): {jain:.2f}"
                     if isinstance(jain, (int, float)) else "") + ".", ""]
    if by_tier:
        lines += ["| tier | client rounds ok | share |", "|---|---|---|"]
        total = sum(by_tier.values())
        lines += [f"| {tier} | {n} | {n / total:.0%} |" for tier, n in sorted(by_tier.items())] + [""]
    return lines


def _units_server_section(rows: list[dict], summary: dict) -> list[str]:
    """The units mode's server work per step (fedfusion.units.ledger: its compute, checks and traffic priced on its
    catalog tier) and the same steps on the cloud GPU, against the step's virtual time through the devices."""
    steps = [r for r in rows if r.get("cloud_step_s")]
    if not steps:
        return []
    cols = ("step", "server_flops", "server_compute_s", "server_verify_flops", "server_verify_s", "server_egress_bytes",
            "server_ingress_bytes", "server_comm_s", "server_energy_j", "cloud_step_s", "virtual_s")
    lines = ["", f"## Server and cloud (units.server_device `{summary.get('server_device')}`, report.cloud "
             f"`{summary.get('cloud_device')}`)", "",
             "| " + " | ".join(cols) + " | units / cloud |", "|" + "---|" * (len(cols) + 1)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + f" | {r['virtual_s'] / r['cloud_step_s']:.0f}x |"
              for r in steps]
    virtual, cloud = sum(r["virtual_s"] for r in steps), sum(r["cloud_step_s"] for r in steps)
    devices_j = sum(r.get("energy_j", 0.0) - r.get("server_energy_j", 0.0) for r in steps)
    lines += ["", f"Edge vs cloud: the same {len(steps)} steps (the devices' units, each once, and the server's own "
              f"compute) take {cloud:.3g} s on {summary.get('cloud_device')} at the catalog's sustained rate, "
              f"{summary.get('cloud_energy_j', 0.0):.3g} J; through the devices {virtual:.3g} virtual s "
              f"({virtual / cloud:.0f}x), {devices_j:.3g} J on the devices and {summary.get('server_energy_j', 0.0):.3g} "
              "J on the server (its compute, checks and traffic, priced with price_work)."]
    return lines


def _server_memory(summary: dict) -> str:
    """The server process's peak resident memory, where the summary has it (runs written before it was recorded
    do not)."""
    peak = summary.get("server_peak_rss_mb")
    return f", the server process's peak resident memory {peak:,.0f} MiB" if peak is not None else ""


def units_report(run: Path, rows: list[dict], summary: dict, out: Path) -> Path:
    """report.md in ``out`` of a units-mode run (fedfusion.run.units): one line per optimizer step, what it moved
    and cost."""
    lines = [f"# Run report: {_label(run)} (units mode: central training, linear layers on the devices)", "",
             f"Status: **{summary.get('status')}**", ""]
    if summary.get("status") == "ok":
        first, last = summary["initial"], summary["final"]
        lines += [f"Target: {summary['target_params']:,} parameters, {summary['steps']} steps, offload "
                  f"`{summary['offload']}`, {summary['devices']} devices, {summary['wall_s']:.0f} s wall"
                  f"{_server_memory(summary)}. Held-out loss "
                  f"{first['eval_loss']:.4f} -> {last['eval_loss']:.4f}; {summary['bytes_down'] / 1e6:.1f} MB down, "
                  f"{summary['bytes_up'] / 1e6:.1f} MB up, {summary['virtual_s']:.2f} virtual s in all; the devices' "
                  f"work priced at {summary.get('energy_j', 0.0):.1f} J and {summary.get('co2_g', 0.0):.3f} g CO2e "
                  f"(clients.jsonl, one row per device and step); devices taken offline: {summary['offline'] or 'none'}.",
                  ""]
    cols = ("step", "train_loss", "eval_loss", "phases", "messages", "bytes_down", "bytes_up", "virtual_s",
            "virtual_bound_s", "server_link_utilisation", "energy_j", "redispatched", "wall_s")
    lines += ["| " + " | ".join(cols) + " | step / bound | missed deadlines |", "|" + "---|" * (len(cols) + 2)]
    for row in rows:
        bound = row.get("virtual_bound_s")
        cells = [_fmt(row.get(c)) for c in cols] + [f"{row['virtual_s'] / bound:.2f}" if bound else "",
                                                    str(len(row.get("missed", [])))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _units_server_section(rows, summary)
    if summary.get("sample"):
        lines += ["", "Sample from the final target (top-k 10):", "", "```", summary["sample"], "```"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _privacy_lines(recipe: Any, clients: list[dict[str, Any]]) -> list[str]:
    """With ``privacy.mode=dp_sgd``: the mechanism and the epsilon each client spent (its last accounted round)."""
    privacy = OmegaConf.select(recipe, "privacy", default=None) or {}
    if privacy.get("mode") != "dp_sgd":
        return []
    spent: dict[int, float] = {}
    for row in clients:
        if row.get("epsilon") is not None:
            spent[row["partition"]] = row["epsilon"]
    sigmas = sorted({row["noise_multiplier"] for row in clients if row.get("noise_multiplier") is not None})
    noise = (f"noise multiplier {privacy['noise_multiplier']:g}" if privacy["noise_multiplier"] or not sigmas else
             f"noise multiplier calibrated per client to the budget, {sigmas[0]:.3g} to {sigmas[-1]:.3g}")
    head = (f"Privacy: DP-SGD on every device (per-example gradients clipped to {privacy['clipping_norm']:g}, "
            f"{noise}; Opacus' RDP accountant at delta {privacy['delta']:g}, budget {privacy['epsilon']:g} per client).")
    if not spent:
        return [head + " No client trained.", ""]
    values = sorted(spent.values())
    return [f"{head} Epsilon spent: at most {values[-1]:.3g}, median {values[len(values) // 2]:.3g}, over the "
            f"{len(values)} clients that trained (each client's in `clients.jsonl`, column `epsilon`).", ""]


def _secure_lines(recipe: Any, rows: list[dict[str, Any]], clients: list[dict[str, Any]]) -> list[str]:
    """With ``privacy.secure_aggregation``: what the server held (sums of masked updates, no client's own) and what
    the protocol's extra steps cost (``secagg_bytes`` per client row, ``secagg_s`` per round)."""
    if not OmegaConf.select(recipe, "privacy.secure_aggregation", default=False):
        return []
    extra = [row["secagg_bytes"] for row in clients if row.get("secagg_bytes")]
    seconds = sum(row.get("secagg_s") or 0.0 for row in rows)
    void = sum(1 for row in rows if row.get("void"))
    cost = (f" Its extra steps (keys, shares, unmasking) moved {sum(extra) / len(extra) / 1e3:.1f} kB per trained "
            f"client on average (`clients.jsonl`, `secagg_bytes`) and took {seconds:.1f} s of the server's time "
            f"(`metrics.jsonl`, `secagg_s`)." if extra else " No client trained.")
    voided = f" {void} round(s) void (too few good replies or survivors to unmask: the target kept)." if void else ""
    return [f"Secure aggregation: each round the server folded the sum of the clients' masked updates and never held "
            f"one client's update (`fedfusion.wire.secagg`).{cost}{voided}", ""]


def write_report(run: Path, out: Path | None = None) -> Path:
    """report.md and plots/ for one run directory, written into ``out`` (default: the run directory itself)."""
    rows, summary = _load(run)
    out = run if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    if summary.get("mode") in CENTRAL or (rows and "step" in rows[0]):
        return units_report(run, rows, summary, out)
    recipe = _recipe(run)
    clients = read_jsonl(run / "clients.jsonl") if (run / "clients.jsonl").is_file() else []
    plots = plot_curves([run], out / "plots")
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
        tiers = holder_recall(rows, f.get("probes_by_tier"))
        if tiers is not None:
            lines += [f"Recall by the device tier of the client holding the fact (the recipe's population): {tiers}. "
                      "A tier far below the others is one whose clients' knowledge is not reaching the target.", ""]
        general = forgetting(rows)
        if general is not None:
            lines += [f"General-text loss (text the pretrained target already modelled): {forgetting_text(general)}.",
                      ""]
        rising = still_rising([r["probe_acc"] for r in rows if r.get("probe_acc") is not None])
        if rising is not None:
            lines += [f"Still rising: the last {rising[0]} evaluations gained {100 * rising[1]:.1f} points of recall; "
                      "the budget (`rounds`) may be too short for these facts.", ""]
    lines += [f"Status: **{summary.get('status')}**", ""]
    lines += _privacy_lines(recipe, clients) + _secure_lines(recipe, rows, clients)
    if summary.get("status") == "ok":
        lines += [
            f"Target: {summary['target_params']:,} parameters, {summary['rounds']} rounds, "
            f"{summary['wall_s']:.0f} s wall" + _server_memory(summary) + ". " + _cost_line(recipe, rows, summary),
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
    lines += _data_section(run, out)
    lines += (_family_section(rows, summary) + _work_section(recipe, clients, rows)
              + _participation_section(recipe, clients, summary))
    lines += ["## Rounds", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    lines += [""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    lines += [_edge_cloud_section(recipe, clients), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def compare_runs(runs: list[Path], out_dir: Path) -> Path:
    """Side-by-side report of several runs: overlaid curves and a table of final and best metrics."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_curves(runs, out_dir / "plots")
    loaded = [(run, *_load(run)) for run in runs]
    lines = ["# Comparison", "",
             "**final** is the last round's evaluation (what the run ends with); **best** is the best round's "
             "(lowest loss and perplexity, highest accuracy, round 0 = the initial target included), with that "
             "round in parentheses (a run with `train.eval_every` > 1: among the rounds it scored). Where they "
             "differ, the run ended worse than it had been.", ""]
    facts = [_label(run) for run, _, summary in loaded if "facts" in summary]
    if facts:
        lines += [f"Knowledge runs ({', '.join(facts)}) score their probes: loss is the probe answer loss "
                  "(nats/token), acc the probe accuracy.", ""]
    lines += ["| run | status | rounds | final loss | final ppl | final acc | best loss (round) | best ppl (round) | "
              "best acc (round) | energy J | CO2e g | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, rows, summary in loaded:
        last = {**_last_scored(rows), "round": rows[-1]["round"]}
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
