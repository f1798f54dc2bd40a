"""Run reports: the headline shows the final AND the best round, comparisons say which is which, plots are titled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.figure
import pytest

from fedfusion.analysis import report
from fedfusion.analysis.report import compare_runs, plot_curves, write_report

# the last round is worse than the best one (round 2), as in many real runs
LOSSES = [4.1, 3.0, 2.2, 2.6, 2.9]
ACCS = [0.05, 0.20, 0.31, 0.28, 0.25]


@pytest.fixture(autouse=True)
def words_only(request, monkeypatch):
    """Tests of a report's words skip rendering its plots (about a second each on 2 cores); the tests that
    check the plots (they use ``saved_figures``) render them, and tests/test_cli.py renders a whole report."""
    if "saved_figures" not in request.fixturenames:
        monkeypatch.setattr(report, "plot_curves", lambda runs, out_dir: [])


def fake_run(path: Path, losses: list[float] = LOSSES, accs: list[float] = ACCS, facts: bool = False) -> Path:
    path.mkdir(parents=True)
    rows = [{"round": i, "eval_loss": loss, "eval_ppl": math.exp(loss), "eval_acc": acc, "energy_j": 10.0 * i,
             "co2_g": 0.001 * i, **({"probe_acc": acc} if facts else {})}
            for i, (loss, acc) in enumerate(zip(losses, accs))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pick = {k: 0 for k in ("eval_loss", "eval_ppl", "eval_acc")}
    summary = {
        "status": "ok", "name": path.name, "rounds": len(rows) - 1, "target_params": 123456,
        "initial": {k: rows[0][k] for k in pick}, "final": {k: rows[-1][k] for k in pick},
        "energy_j": sum(r["energy_j"] for r in rows), "wasted_j": 0.0, "co2_g": sum(r["co2_g"] for r in rows),
        "virtual_s": 12.0, "wall_s": 3.0, "sample": "To be, or not",
    }
    if facts:
        summary["facts"] = {"probe_acc": accs[-1], "best_probe_acc": max(accs), "largest_client_share": 0.4,
                            "clients": 4, "probes": 40}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_single_run_headline_shows_final_and_best_with_its_round(tmp_path):
    text = write_report(fake_run(tmp_path / "run")).read_text()
    ppl = [f"{math.exp(v):.2f}" for v in LOSSES]
    assert (f"Held-out perplexity {ppl[0]} -> final **{ppl[4]}** (round 4), best **{ppl[2]}** (round 2)"
            in text)
    assert "next-character accuracy 0.050 -> final **0.250** (round 4), best **0.310** (round 2)" in text
    assert "The final round is not the best one" in text


def test_a_run_whose_last_round_is_best_says_so_plainly(tmp_path):
    text = write_report(fake_run(tmp_path / "run", [4.0, 3.0, 2.0], [0.1, 0.2, 0.3])).read_text()
    assert "final **0.300** (round 2), best **0.300** (round 2)" in text
    assert "not the best" not in text


def test_knowledge_run_headline_scores_probes_final_and_best(tmp_path):
    text = write_report(fake_run(tmp_path / "facts", facts=True)).read_text()
    assert "The target recalls 25.0 % of all 4 clients' 40 facts** after the final round (best: 31.0 % at round 2)" in text
    assert "Probe answer loss 4.100 -> final **2.900** nats/token (round 4), best **2.200** nats/token (round 2)" in text
    assert "probe accuracy 0.050 -> final **0.250** (round 4), best **0.310** (round 2)" in text
    assert "Held-out perplexity" not in text


def test_knowledge_report_gives_recall_by_the_holders_tier_when_the_rows_score_it(tmp_path):
    run = fake_run(tmp_path / "facts", facts=True)
    assert "device tier of the client holding" not in write_report(run).read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[-1].update({"probe_acc/phone": 0.125, "answer_loss/phone": 3.5, "probe_acc/laptop": 0.5,
                     "answer_loss/laptop": 1.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run / "summary.json").read_text())
    summary["facts"]["probes_by_tier"] = {"phone": 24, "laptop": 16}
    (run / "summary.json").write_text(json.dumps(summary))
    text = write_report(run).read_text()
    assert ("Recall by the device tier of the client holding the fact (the recipe's population): phone 12.5 % of 24 "
            "(answer loss 3.500), laptop 50.0 % of 16 (answer loss 1.250).") in text


def test_knowledge_report_says_when_recall_is_still_rising_and_not_when_it_is_flat(tmp_path):
    losses = [4.0 - 0.1 * i for i in range(9)]
    rising = [0.0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40]  # +0.05 a round to the end: 3 rounds gain 0.15
    text = write_report(fake_run(tmp_path / "rising", losses, rising, facts=True)).read_text()
    assert "Still rising: the last 3 evaluations gained 15.0 points of recall" in text
    flat = [0.0, 0.20, 0.30, 0.35, 0.38, 0.40, 0.41, 0.40, 0.41]  # saturated: the last 3 rounds move by noise
    text = write_report(fake_run(tmp_path / "flat", losses, flat, facts=True)).read_text()
    assert "Still rising" not in text


def test_still_rising_needs_a_clear_gain_over_the_last_evaluations():
    assert report.still_rising([0.0, 0.1, 0.2, 0.3]) == (3, pytest.approx(0.3))
    # a real 30-round knowledge run (smallest-only, 1,200 facts): the last 3 evaluations alone look flat
    curve = [0.0, 0.013, 0.038, 0.038, 0.048, 0.058, 0.058, 0.043, 0.06, 0.055, 0.057, 0.052, 0.064, 0.07, 0.058,
             0.069, 0.072, 0.075, 0.072, 0.089, 0.093, 0.102, 0.107, 0.108, 0.122, 0.127, 0.142, 0.163, 0.172, 0.161,
             0.171]
    assert report.still_rising(curve) == (6, pytest.approx(0.0525, abs=0.001))
    assert report.still_rising([0.0, 0.5, 0.502, 0.504, 0.506]) is None  # under 0.01 in 3 evaluations
    assert report.still_rising([0.0, 0.6, 0.6, 0.61, 0.62]) is None  # 0.02, under 5 % of the whole rise (0.62)
    assert report.still_rising([0.0, 0.4, 0.41]) is None  # too few evaluations to judge
    assert report.still_rising([0.3, 0.2, 0.1, 0.0]) is None  # falling


def test_comparison_table_has_final_and_best_and_says_which_is_which(tmp_path):
    a = fake_run(tmp_path / "dips")
    b = fake_run(tmp_path / "steady", [4.0, 3.0, 2.0], [0.1, 0.2, 0.3])
    text = compare_runs([a, b], tmp_path / "cmp").read_text()
    assert "**final** is the last round's evaluation" in text and "**best** is the best round's" in text
    header = next(line for line in text.splitlines() if line.startswith("| run |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[:9] == ["run", "status", "rounds", "final loss", "final ppl", "final acc", "best loss (round)",
                         "best ppl (round)", "best acc (round)"]
    assert f"| dips | ok | 4 | 2.9000 | {math.exp(2.9):.3f} | 0.2500 | 2.2000 (2) | {math.exp(2.2):.3f} (2) | 0.3100 (2) |" in text
    assert "| steady | ok | 2 | 2.0000 |" in text and "| 0.3000 (2) |" in text


@pytest.fixture
def saved_figures(monkeypatch):
    figures = []
    save = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)  # draws the figure: its ticks are placed by the locator then, once

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return figures


def test_every_plot_has_a_title_and_integer_round_ticks(tmp_path, saved_figures):
    paths = plot_curves([fake_run(tmp_path / "a"), fake_run(tmp_path / "b", [4.0, 3.5, 3.0], [0.1, 0.2, 0.3])],
                        tmp_path / "plots")
    assert len(saved_figures) == len(paths) == 4
    round_axes = 0
    for fig in saved_figures:
        for ax in fig.axes:
            assert ax.get_title(), f"untitled plot: {ax.get_ylabel()} vs {ax.get_xlabel()}"
            if ax.get_xlabel() == "round":
                round_axes += 1
                ticks = ax.get_xticks()
                assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks
    assert round_axes == 3


def test_knowledge_run_plots_name_the_probe_metrics(tmp_path, saved_figures):
    plot_curves([fake_run(tmp_path / "facts", facts=True)], tmp_path / "plots")
    labels = [ax.get_ylabel() for fig in saved_figures for ax in fig.axes]
    assert "probe accuracy" in labels and "next-character accuracy" not in labels


CLIENT_ROW = {"round": 1, "device": "laptop", "status": "ok", "params": 300_000, "tokens": 40_960,
              "bytes_down": 1_200_000, "bytes_up": 1_200_000}


def test_edge_cloud_section_names_the_recipe_cloud_both_views_and_the_dominant_cost(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "clients.jsonl").write_text(json.dumps(CLIENT_ROW) + "\n" + json.dumps({**CLIENT_ROW, "device": "phone"}) + "\n")
    (run / "recipe.yaml").write_text("report:\n  cloud: cloud-a5000\n")
    text = write_report(run).read_text()
    section = text[text.index("## Edge vs cloud"):]
    assert "**Cloud reference: one cloud NVIDIA RTX A5000" in section and "`report.cloud`" in section
    assert "CO2e attributionally" in section and "consequentially" in section
    assert "The edge's energy goes mostly to" in section and "CO2e mostly to" in section
    assert "| consequential (seed paper) |" in section and "### What flips the verdict" in section


def test_edge_cloud_section_without_the_recipe_cloud_lists_the_catalog_cloud_tiers(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "clients.jsonl").write_text(json.dumps(CLIENT_ROW) + "\n")
    (run / "recipe.yaml").write_text("report:\n  cloud: cloud-tpu\n")
    text = write_report(run).read_text()
    assert "'cloud-tpu' is not in the device catalog; its cloud tiers: cloud-a5000, cloud-a100, cloud-h100" in text


def distill_run(path: Path) -> Path:
    """A distillation run: clients' rows add up to 19.54 J, the server's distillation to 52.97 J."""
    run = fake_run(path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        r.update({"server_energy_j": 52.97 / 4, "server_co2_g": 0.002, "server_flops": 1e12,
                  "family_tiny_loss": 3.0 - 0.1 * r["round"], "family_tiny_ppl": math.exp(3.0 - 0.1 * r["round"]),
                  "family_tiny_acc": 0.2, "family_small_loss": 2.8, "family_small_ppl": math.exp(2.8),
                  "family_small_token_acc": 0.15})
        r["energy_j"] = 19.54 / 4 + r["server_energy_j"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run / "summary.json").read_text())
    summary.update(energy_j=sum(r["energy_j"] for r in rows), co2_g=0.01)
    (run / "summary.json").write_text(json.dumps(summary))
    clients = [{**CLIENT_ROW, "round": i, "device": d, "assignment": {"family": f}, "params": p, "energy_j": 19.54 / 8}
               for i in range(1, 5) for d, f, p in (("phone", "tiny", 39_328), ("laptop", "small", 99_648))]
    (run / "clients.jsonl").write_text("".join(json.dumps(c) + "\n" for c in clients))
    (run / "recipe.yaml").write_text("fusion:\n  method: distill\ndistill:\n  server_device: cloud-a100\n")
    return run


def test_distill_report_separates_clients_from_the_server_and_scores_every_family(tmp_path):
    text = write_report(distill_run(tmp_path / "distill")).read_text()
    assert "Clients' work priced on their device profiles: 19.5 J" in text
    assert "The server's distillation, priced on cloud-a100: 53.0 J (4e+12 FLOPs)" in text
    assert "Together 72.5 J" in text
    families = text[text.index("## Client families"):]
    assert "| family tiny | 2.6000 |" in families and "0.2000 (next-character accuracy)" in families
    assert "| family small | 2.8000 |" in families and "0.1500 (next-token accuracy)" in families
    work = text[text.index("## Who did the work"):]
    assert "| phone | family tiny | 39,328 | 4 | 0 | 9.77 |" in work
    assert "| laptop | family small | 99,648 | 4 | 0 | 9.77 |" in work
    assert "| server (cloud-a100) | the server's distillation |" in work and "| 52.97 |" in work


def test_a_run_without_server_work_keeps_one_cost_line_and_no_family_table(tmp_path):
    text = write_report(fake_run(tmp_path / "run")).read_text()
    assert "Clients' work priced on their device profiles: 100.0 J" in text and "server" not in text.lower()
    assert "## Client families" not in text


def test_labels_follow_what_the_target_is_scored_on(tmp_path, saved_figures):
    run = fake_run(tmp_path / "lora")
    summary = json.loads((run / "summary.json").read_text())
    names = {"eval_loss": "held-out response loss (nats/token)", "eval_ppl": "held-out response perplexity",
             "eval_acc": "next-token accuracy (response tokens)"}
    (run / "summary.json").write_text(json.dumps({**summary, "metric_names": names}))
    text = write_report(run).read_text()
    assert "Held-out response perplexity" in text and "next-token accuracy (response tokens) 0.050 -> final" in text
    assert "next-character" not in text
    labels = [ax.get_ylabel() for fig in saved_figures for ax in fig.axes]
    assert "next-token accuracy (response tokens)" in labels and "held-out response loss (nats/token)" in labels


def test_generative_report_names_each_tiers_own_model_and_the_servers_training(tmp_path):
    run = distill_run(tmp_path / "generative")
    clients = [{**CLIENT_ROW, "round": i, "device": "phone", "width": 0.125, "params": 58_944, "energy_j": 0.5}
               for i in range(1, 5)]
    (run / "clients.jsonl").write_text("".join(json.dumps(c) + "\n" for c in clients))
    (run / "recipe.yaml").write_text("fusion:\n  method: generative\ngenerative:\n  server_device: cloud-h100\n")
    text = write_report(run).read_text()
    assert "The server's training on the samples, priced on cloud-h100: 53.0 J" in text
    assert "| phone | its own model (the static slice at width 0.125) | 58,944 | 4 | 0 | 2 |" in text
    assert "| server (cloud-h100) | the server's training on the samples |" in text
    assert "sampling (writing the windows it sends) is not priced" in text


def test_participation_section_says_who_was_selected_dropped_cut_and_how_fairly(tmp_path):
    run = fake_run(tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "participation_jain": 0.5}))
    rows = [{**CLIENT_ROW, "partition": 0}, {**CLIENT_ROW, "partition": 0, "round": 2},
            {**CLIENT_ROW, "partition": 1, "device": "phone", "status": "dropped"},
            {**CLIENT_ROW, "partition": 2, "status": "cut"}, {**CLIENT_ROW, "partition": 3, "status": "failed"}]
    (run / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "recipe.yaml").write_text("selection:\n  method: energy\npopulation:\n  num_clients: 4\n"
                                     "availability:\n  enabled: true\n")
    text = write_report(run).read_text()
    section = text[text.index("## Selection and participation"):]
    assert "Selector **energy**; availability model **on**." in section
    assert "asked 5 client rounds: 2 ok, 1 dropped before training (unavailable), 1 cut by over-selection, " \
           "1 failed or rejected" in section
    assert "1 of the population's 4 clients trained at least once" in section and "equally often): 0.50." in section
    assert "| laptop | 2 | 100% |" in section


def test_a_run_whose_every_reply_failed_has_no_edge_cloud_comparison_and_still_reports(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "clients.jsonl").write_text(json.dumps({**CLIENT_ROW, "status": "failed"}) + "\n")
    text = write_report(run).read_text()
    assert "No client work reached the model" in text[text.index("## Edge vs cloud"):]
