"""`fedfusion compare`: the arms per method (pure), the equal-budget check, the report's math on synthetic curves,
resume with a mock runner, the CLI's up-front errors, the docs' command; one slow run through Flower."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfusion.cli import main, parser
from fedfusion.config.recipe import builtin_recipes, load_recipe, to_yaml
from fedfusion.config.sections import RecipeError
from fedfusion.run import arms as arms_module
from fedfusion.run.arms import ARM_NAMES, ORACLE, RECIPE, SMALLEST, Arm, UnequalBudget, arms_for, check_equal_budget
from fedfusion.run.check import load_checked
from fedfusion.run.compare import (
    EXIT_INTERRUPTED,
    Comparison,
    Metric,
    analyse,
    collect_run,
    execute,
    noise,
    plan,
    rising,
    state,
    tier_closure,
    write_report,
)
from fedfusion.run.federation import build_methods
from fedfusion.run.targets import lm_target
from tests.processes import session_members
from tests.ray_actors import ONE_ACTOR

ROOT = Path(__file__).parents[1]
LOSS = Metric("eval_loss", "held-out loss (nats)", True)
RECALL = Metric("probe_acc", "probe accuracy", False)
SLICE_FORWARD = {"fusion.forward=slice", "fusion.window_core=false", "fusion.window_shared=false",
                 "fusion.window_outside_core=false"}


# -- the arms per method, from the shipped recipes (pure: nothing runs) ----------------------------------------------
@pytest.mark.usefixtures("lora_base_installed", "smollm2_config_dir")
@pytest.mark.parametrize("name", sorted(builtin_recipes()))
def test_every_shipped_recipe_has_its_arms_or_a_clear_refusal_and_they_share_its_budget(name, tmp_path):
    """Every built-in recipe (a new one too, when its method is an existing one) gets three arms whose resolved recipes
    pass the equal-budget check; the exact mode is refused with the reason."""
    recipe = load_checked(name)
    if recipe.fusion.method == "units":
        with pytest.raises(RecipeError, match="compare refuses 'units': the exact mode trains the target centrally"):
            arms_for(recipe)
        return
    comparison = plan(name, [], [0, 1], tmp_path / "out")
    assert list(comparison.arms) == [RECIPE, SMALLEST, ORACLE]
    assert comparison.arms[RECIPE].overrides == ()
    assert comparison.arms[SMALLEST].overrides and comparison.arms[ORACLE].overrides
    assert not (tmp_path / "out").exists()  # planning writes nothing
    budget = ("rounds", "seed", "data", "model", "population", "selection", "train")
    for arm in comparison.arms.values():
        assert not [k for k in arm.declared() if k.split(".")[0] in budget]
    for seed in (0, 1):
        resolved = {a: comparison.recipes[a, seed] for a in comparison.arms}
        assert len({(r.rounds, r.seed, r.selection.clients_per_round, r.train.local_steps, r.train.lr, r.data.source)
                    for r in resolved.values()}) == 1


def test_every_registry_entry_names_an_arms_rule_that_resolves():
    from fedfusion.config.methods import METHODS, hook

    assert all(m.arms and callable(hook(m.arms)) for m in METHODS)


def test_quickstart_arms_are_the_benchmarks_smallest_only_and_oracle():
    """benchmarks/quickstart_policies.py's smallest-only (grow after the last round: the 1/8 model) and oracle (width
    1.0, static, no growth, each slice in its own forward pass), derived from the resolved recipe."""
    recipe = load_checked("quickstart", ["rounds=6"])
    arms = arms_for(recipe)
    assert set(arms[SMALLEST].overrides) == {"fusion.policy=static", "fusion.grow_round=6", *SLICE_FORWARD}
    assert set(arms[ORACLE].overrides) == {"fusion.policy=static", "fusion.grow_round=0", *SLICE_FORWARD,
                                           "fusion.widths={phone: 1.0, laptop: 1.0, desktop: 1.0}"}
    assert "0.125" in arms[SMALLEST].about and arms[SMALLEST].score == ""


def test_a_windows_lr_power_is_the_recipes_alone_the_arms_in_their_own_forward_pass_train_at_the_lr():
    arms = arms_for(load_checked("quickstart", ["rounds=6", "fusion.window_lr_power=0.5"]))
    assert "fusion.window_lr_power=0.0" in arms[SMALLEST].overrides
    assert "fusion.window_lr_power=0.0" in arms[ORACLE].overrides


def test_widths_and_tiers_come_from_the_recipe_not_from_one_recipe():
    recipe = load_checked("rolling", ["population.mix={laptop: 0.5, desktop: 0.5}",
                                      "fusion.widths={laptop: 0.25, desktop: 0.5}"])
    arms = arms_for(recipe)
    assert "0.25 of every sliced axis" in arms[SMALLEST].about
    assert "fusion.widths={laptop: 1.0, desktop: 1.0}" in arms[ORACLE].overrides


def test_knowledge_arms_are_submodel_smallest_slice_and_whole_target_at_the_resolved_rounds():
    """Generative distillation: smallest-only is width slicing's small model at the rounds the facts give (rounds: 0
    resolved), as benchmarks/knowledge_user_facts.py runs it."""
    arms = arms_for(load_checked("knowledge"))
    assert arms[SMALLEST].overrides == ("fusion.method=submodel", "fusion.policy=static", "fusion.grow_round=30")
    assert arms[ORACLE].overrides == ("fusion.method=submodel", "fusion.policy=static", "fusion.widths={phone: 1.0}")


def test_a_users_facts_files_get_the_arms_at_the_rounds_their_facts_give(tmp_path):
    from fedfusion.data.facts import write_facts

    paths = write_facts(tmp_path / "facts", 4, 24, seed=7)  # 24 people x 6 attributes = 144 facts: 4 rounds of 40
    comparison = plan("knowledge", [f"data.path={paths['train']}", f"data.probes={paths['probes']}",
                                    "population.num_clients=4", "selection.clients_per_round=4"], [0], tmp_path / "out")
    assert comparison.recipes[RECIPE, 0].rounds == 4
    assert "fusion.grow_round=4" in comparison.arms[SMALLEST].overrides
    assert comparison.metric.key == "probe_acc" and not comparison.metric.lower_is_better
    assert comparison.recipes[ORACLE, 0].data.path == str(paths["train"])


def test_distill_smallest_only_trains_the_weakest_tiers_family_everywhere_and_scores_that_family():
    arms = arms_for(load_checked("distill"))
    small = arms[SMALLEST]
    assert "distill.tier_family={phone: tiny, laptop: tiny, desktop: tiny}" in small.overrides
    assert {"distill.back_distill=false", "distill.server_steps=1"} <= set(small.overrides)
    assert small.score == "family_tiny_" and small.key("eval_loss") == "family_tiny_loss"
    assert small.key("eval_ppl") == "family_tiny_ppl" and arms[RECIPE].key("eval_loss") == "eval_loss"
    assert "fusion.method=submodel" in arms[ORACLE].overrides


def test_mixed_smallest_only_gives_every_tier_the_weakest_tiers_method():
    arms = arms_for(load_checked("mixed"))
    assert arms[SMALLEST].overrides[:2] == ("fusion.method=distill", "fusion.tiers={}")
    assert arms[SMALLEST].score == "family_tiny_"
    assert {"fusion.method=submodel", "fusion.tiers={}"} <= set(arms[ORACLE].overrides)
    # phones on slices instead: the weakest tier's width for every tier, grown at the last round
    sliced = arms_for(load_checked("mixed", ["fusion.tiers={phone: submodel, laptop: submodel, desktop: distill}",
                                             "fusion.widths={phone: 0.125, laptop: 0.25}", "distill.tier_family={desktop: tiny}"]))
    assert "fusion.widths={phone: 0.125, laptop: 0.25, desktop: 0.125}" in sliced[SMALLEST].overrides
    assert "fusion.grow_round=12" in sliced[SMALLEST].overrides


@pytest.mark.usefixtures("lora_base_installed")
def test_lora_smallest_only_is_the_smallest_rank_on_its_base_and_the_oracle_the_largest_unquantised():
    arms = arms_for(load_checked("rolling", ["fusion.method=lora", "data.source=chatterbot"]))
    assert arms[SMALLEST].overrides == ("lora.ranks={phone: 4, laptop: 4, desktop: 4}",
                                        "lora.quantize={phone: 4, laptop: 4, desktop: 4}")
    assert arms[ORACLE].overrides == ("lora.ranks={phone: 32, laptop: 32, desktop: 32}",
                                      "lora.quantize={phone: 0, laptop: 0, desktop: 0}")


def test_a_pretrained_target_keeps_the_method_and_gives_every_tier_the_weakest_share():
    """Silencing a pretrained target around its smallest slice would throw the pretraining away: smallest-only is
    the recipe with every tier at the weakest width (and window)."""
    recipe = load_recipe("quickstart", ["model.pretrained=some/model", "fusion.window_widths={phone: 0.25}"])
    small = arms_for(recipe)[SMALLEST]
    assert "fusion.widths={phone: 0.125, laptop: 0.125, desktop: 0.125}" in small.overrides
    assert "fusion.window_widths={phone: 0.25, laptop: 0.25, desktop: 0.25}" in small.overrides
    assert not [o for o in small.overrides if o.startswith(("fusion.grow_round", "fusion.policy", "fusion.forward"))]


def test_auto_widths_arms_state_their_widths():
    comparison = plan("quickstart", ["fusion.auto_widths=true"], [0], None)
    fitted = comparison.recipes[RECIPE, 0].fusion.widths
    for name in (SMALLEST, ORACLE):
        assert "fusion.auto_widths=false" in comparison.arms[name].overrides
        assert any(o.startswith("fusion.widths=") for o in comparison.arms[name].overrides)
    assert comparison.recipes[SMALLEST, 0].fusion.widths == fitted


def test_an_engine_setting_for_one_arm_schedules_that_arm_only_and_a_bad_one_is_refused():
    """``--engine oracle:cpus_per_client=2`` (fewer whole-model clients at once) reaches the oracle's runs alone, and
    their recipes as they will load; an arm not run or a key engine lacks is one error naming the spec."""
    comparison = plan("quickstart", [], [0], None, engine=["oracle:cpus_per_client=2"])
    assert "engine.cpus_per_client=2" in comparison.run_args(ORACLE, 0)
    assert not [a for a in comparison.run_args(RECIPE, 0) if a.startswith("engine.")]
    assert comparison.recipes[ORACLE, 0].engine.cpus_per_client == 2
    assert comparison.recipes[RECIPE, 0].engine.cpus_per_client == 1
    for spec in ("oracle:rounds=3", "nobody:cpus_per_client=2", "oracle:cpus_per_client"):
        with pytest.raises(ValueError, match="--engine"):
            plan("quickstart", [], [0], None, engine=[spec])
    with pytest.raises(ValueError, match="--engine"):
        plan("quickstart", [], [0], None, names=[RECIPE], engine=["oracle:cpus_per_client=2"])


# -- the equal-budget check -----------------------------------------------------------------------------------------
def test_the_budget_check_fails_when_an_arm_changes_a_budget_key():
    base = load_checked("quickstart")
    arm = Arm(SMALLEST, ("fusion.policy=static", "train.local_steps=1"), "fewer steps")
    with pytest.raises(UnequalBudget, match="override 'train.local_steps' changes the budget"):
        check_equal_budget(base, {SMALLEST: load_checked("quickstart", list(arm.overrides))}, {SMALLEST: arm})


def test_the_budget_check_fails_on_a_difference_no_override_of_the_arm_names():
    base = load_checked("quickstart")
    arm = Arm(ORACLE, ("fusion.policy=static",), "static")
    other = load_checked("quickstart", ["fusion.policy=static", "rounds=6"])
    with pytest.raises(UnequalBudget, match="oracle arm: rounds is 6, the recipe arm's 12"):
        check_equal_budget(base, {ORACLE: other}, {ORACLE: arm})
    check_equal_budget(base, {ORACLE: load_checked("quickstart", ["fusion.policy=static"])}, {ORACLE: arm})


def test_planning_refuses_an_arm_rule_that_leaves_the_budget(monkeypatch):
    """The check guards the rules themselves: a rule that sneaks in a budget key stops compare before anything runs."""
    def cheating(recipe, weakest=None):
        return (Arm(SMALLEST, ("fusion.policy=static", "selection.clients_per_round=2"), "cheap"),
                Arm(ORACLE, ("fusion.policy=static",), "static"))

    monkeypatch.setattr(arms_module, "slicing_arms", cheating)
    with pytest.raises(UnequalBudget, match="selection.clients_per_round"):
        plan("rolling", [], [0], None)


# -- the report's math ----------------------------------------------------------------------------------------------
def test_rising_needs_a_clear_gain_beyond_its_own_noise():
    flat_end = [4.0, 3.0, 2.5, 2.3, 2.2, 2.2, 2.2, 2.2]
    assert rising(flat_end, lower_is_better=True)["rising"] is False
    falling = [4.0, 3.8, 3.6, 3.4, 3.2, 3.0, 2.8, 2.6]  # a loss still going down: improving
    check = rising(falling, lower_is_better=True)
    assert check["rising"] is True and check["gain"] == pytest.approx(0.6) and check["k"] == 3
    assert rising([0.1, 0.2, 0.3, 0.4, 0.5], lower_is_better=False)["rising"] is True
    noisy = [0.1, 0.3, 0.2, 0.4, 0.2, 0.45, 0.25, 0.5]  # up on average, but not beyond twice its standard error
    assert rising(noisy, lower_is_better=False)["rising"] is False
    assert rising([1.0, 0.9, 0.8], lower_is_better=True) is None  # fewer than 4 scored rounds
    assert noise([1.0, 1.1, 1.2, 1.3]) == pytest.approx(0.0, abs=1e-12) and noise([1.0, 2.0]) is None


def run_entry(curve: list[float], lower: bool = True) -> dict:
    values = list(curve)
    return {"dir": "x", "curve": list(enumerate(values)), "final": values[-1], "last3": sum(values[-3:]) / 3,
            "final_ppl": None, "noise": noise(values), "rising": rising(values, lower), "wall_s": 1.0, "machine": None}


def test_span_and_closure_are_oriented_so_that_positive_is_better():
    """Loss: span = smallest-only's loss minus the oracle's; closure = (smallest - recipe) / span, per seed."""
    runs = {RECIPE: {0: run_entry([3.0, 2.9, 2.8, 2.7, 2.6]), 1: run_entry([3.0, 2.9, 2.8, 2.7, 2.5])},
            SMALLEST: {0: run_entry([3.0, 2.95, 2.9, 2.85, 2.8]), 1: run_entry([3.0, 2.95, 2.9, 2.85, 2.8])},
            ORACLE: {0: run_entry([3.0, 2.8, 2.6, 2.5, 2.4]), 1: run_entry([3.0, 2.8, 2.6, 2.45, 2.3])}}
    stats = analyse(runs, LOSS)
    assert stats["per_seed"][0]["span"] == pytest.approx(0.4) and stats["per_seed"][1]["span"] == pytest.approx(0.5)
    assert stats["per_seed"][0]["closure"] == pytest.approx(0.5) and stats["per_seed"][1]["closure"] == pytest.approx(0.6)
    assert stats["span_resolved"] and stats["closure"][0] == pytest.approx(0.55)
    assert stats["recipe_better_in"] == 2
    # probe accuracy, higher is better: the same numbers mirrored give the same span and closure
    mirrored = {a: {s: run_entry([-v for _, v in r["curve"]], lower=False) for s, r in by.items()} for a, by in runs.items()}
    again = analyse(mirrored, RECALL)
    assert again["per_seed"][0]["span"] == pytest.approx(0.4) and again["closure"][0] == pytest.approx(0.55)


def test_a_span_within_the_round_to_round_noise_gets_no_closure():
    wobble = [3.0, 2.5, 2.7, 2.4, 2.65, 2.45, 2.6]
    runs = {RECIPE: {0: run_entry([3.0, 2.5, 2.7, 2.4, 2.6, 2.5, 2.55])}, SMALLEST: {0: run_entry(wobble)},
            ORACLE: {0: run_entry([3.0, 2.5, 2.7, 2.4, 2.65, 2.45, 2.58])}}
    stats = analyse(runs, LOSS)
    seed = stats["per_seed"][0]
    assert seed["span"] == pytest.approx(0.02) and seed["resolved"] is False and seed["closure"] is None
    assert not stats["span_resolved"] and "closure" not in stats


def test_an_oracle_worse_than_smallest_only_has_no_gap_to_close():
    runs = {RECIPE: {0: run_entry([3.0, 2.6, 2.4, 2.3, 2.2])}, SMALLEST: {0: run_entry([3.0, 2.6, 2.4, 2.3, 2.2])},
            ORACLE: {0: run_entry([3.0, 2.9, 2.8, 2.7, 2.6])}}
    stats = analyse(runs, LOSS)
    assert stats["span_resolved"] and stats["span"][0] == pytest.approx(-0.4) and "closure" not in stats
    assert stats["per_seed"][0]["closure"] is None  # no gap to close, whatever the recipe did


def write_run(path: Path, recipe, curve: list[float], key: str = "eval_loss", extra: dict | None = None) -> None:
    """A finished run directory as ``fedfusion run`` leaves it (the parts compare reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "recipe.yaml").write_text(to_yaml(recipe))
    rows = [{"round": r, key: v, "eval_loss": v, "eval_ppl": 2.718 ** v, **(extra or {})} for r, v in enumerate(curve)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"status": "ok", "wall_s": 12.5, "metric_names": {
        "eval_loss": "held-out loss (nats/char)"}, "versions": {"machine": "x86_64 Linux"}}))


TINY = ["rounds=2", "population.num_clients=4", "selection.clients_per_round=3", "model.hidden_size=32",
        "model.num_heads=4", "model.num_kv_heads=4", "model.intermediate_size=64", "model.num_layers=1",
        "train.local_steps=2", "train.batch_size=4", "train.seq_len=32", "data.eval_chars=3000"]


def test_the_report_writes_json_md_and_plot_with_per_seed_finals_span_closure_and_rising(tmp_path):
    c = plan("quickstart", ["rounds=6"], [0, 1], tmp_path, command="fedfusion compare quickstart rounds=6 --seeds 0 1")
    curves = {RECIPE: [3.0, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3], SMALLEST: [3.0, 2.9, 2.85, 2.8, 2.78, 2.76, 2.75],
              ORACLE: [3.0, 2.7, 2.5, 2.35, 2.25, 2.2, 2.15]}
    for arm, curve in curves.items():
        for seed in (0, 1):
            write_run(c.run_dir(arm, seed), c.recipes[arm, seed], [v + 0.01 * seed for v in curve])
    paths = write_report(c)
    assert [p.name for p in paths] == ["compare.md", "compare.json", "compare.png"]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["arms"][SMALLEST]["overrides"] == list(c.arms[SMALLEST].overrides)
    assert data["analysis"]["per_seed"]["0"]["span"] == pytest.approx(0.6)
    assert data["analysis"]["closure"][0] == pytest.approx(0.75)
    assert data["budget"]["rounds"] == 6 and data["metric"]["label"] == "held-out loss (nats/char)"
    md = (tmp_path / "compare.md").read_text()
    assert "Command: `fedfusion compare quickstart rounds=6 --seeds 0 1`" in md and "Machine: " in md
    assert "| recipe | 0 | 2.3000 | 2.4000 |" in md and "| recipe | mean ± std | 2.3050 ± 0.0071 |" in md
    assert "the recipe closes **0.75 ± 0.00** of that gap" in md and "Still rising at the end: recipe (seed 0)" in md
    assert "![curves](compare.png)" in md


def test_a_run_whose_client_rounds_failed_is_counted_and_the_report_says_it_is_not_at_equal_budget(tmp_path):
    c = plan("quickstart", ["rounds=6"], [0], tmp_path)
    for arm in ARM_NAMES:
        write_run(c.run_dir(arm, 0), c.recipes[arm, 0], [3.0, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3])
    clients = [{"round": r, "status": "ok" if r < 5 else "failed"} for r in range(1, 7) for _ in range(2)]
    (c.run_dir(RECIPE, 0) / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clients))
    (c.run_dir(ORACLE, 0) / "clients.jsonl").write_text(json.dumps({"round": 1, "status": "ok"}) + "\n")
    write_report(c)
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [data["arms"][a]["runs"]["0"]["failed"] for a in ARM_NAMES] == [4, 0, 0]
    md = (tmp_path / "compare.md").read_text()
    assert "**Not at equal budget**: client rounds failed in recipe (seed 0: 4)" in md
    assert "smallest-only (seed 0" not in md.split("Not at equal budget")[1].split(";")[0]


def test_a_pretrained_targets_forgetting_is_a_column_per_run_and_absent_where_no_run_scores_it(tmp_path):
    """Runs whose rows score general_loss (a pretrained target's text it already modelled) get a column: round 0 ->
    final and the change; a comparison of runs without it has no such column."""
    c = plan("quickstart", ["rounds=6"], [0], tmp_path / "with")
    for i, arm in enumerate(ARM_NAMES):
        write_run(c.run_dir(arm, 0), c.recipes[arm, 0], [3.0, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3])
        path = c.run_dir(arm, 0) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "general_loss": 2.0 + 0.1 * i * r["round"]}) + "\n" for r in rows))
    write_report(c)
    md = (tmp_path / "with" / "compare.md").read_text()
    assert "general-text loss: round 0 -> final (forgetting) |" in md
    assert "| recipe | 0 | 2.3000 | 2.4000 | 9.972 | 2.000 -> 2.000 nats/token (+0.0 %) |" in md
    assert "| oracle | 0 | 2.3000 | 2.4000 | 9.972 | 2.000 -> 3.200 nats/token (+60.0 %) |" in md
    data = json.loads((tmp_path / "with" / "compare.json").read_text())
    assert data["arms"][SMALLEST]["runs"]["0"]["general_loss"] == [2.0, pytest.approx(2.6)]
    bare = plan("quickstart", ["rounds=6"], [0], tmp_path / "without")
    for arm in ARM_NAMES:
        write_run(bare.run_dir(arm, 0), bare.recipes[arm, 0], [3.0, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3])
    write_report(bare)
    assert "general-text loss" not in (tmp_path / "without" / "compare.md").read_text()


def test_facts_runs_get_the_holders_tier_table_with_each_tiers_answer_loss_closure(tmp_path):
    """Runs whose rows score the facts by the holder's tier (``probe_acc/<tier>``) get a table: each arm's final
    recall and answer loss per tier, and the recipe's closure on answer loss; runs without those keys get none."""
    c = plan("quickstart", ["rounds=6"], [0], tmp_path / "tiers")
    losses = {RECIPE: {"phone": 3.0, "laptop": 2.0}, SMALLEST: {"phone": 4.0, "laptop": 4.0},
              ORACLE: {"phone": 2.0, "laptop": 1.5}}
    for arm in ARM_NAMES:
        extra = {"probe_acc": 0.25, "answer_loss": 2.5, "probe_acc/phone": 0.1, "probe_acc/laptop": 0.4,
                 **{f"answer_loss/{t}": v for t, v in losses[arm].items()}}
        write_run(c.run_dir(arm, 0), c.recipes[arm, 0], [0.0, 0.1, 0.2, 0.25], key="probe_acc", extra=extra)
        summary = json.loads((c.run_dir(arm, 0) / "summary.json").read_text())
        summary["facts"] = {"probes": 48, "probes_by_tier": {"phone": 30, "laptop": 18}}
        (c.run_dir(arm, 0) / "summary.json").write_text(json.dumps(summary))
    c.metric = RECALL
    write_report(c)
    md = (tmp_path / "tiers" / "compare.md").read_text()
    assert "| seed | tier | probes | recall | answer loss | answer-loss closure |" in md
    # phone: (4 - 3) / (4 - 2) = 0.50; laptop: (4 - 2) / (4 - 1.5) = 0.80; every tier: the same loss in all arms
    assert "| 0 | phone | 30 | 0.1000 / 0.1000 / 0.1000 | 3.000 / 4.000 / 2.000 | 0.50 |" in md
    assert "| 0 | laptop | 18 | 0.4000 / 0.4000 / 0.4000 | 2.000 / 4.000 / 1.500 | 0.80 |" in md
    assert "| 0 | * | 48 | 0.2500 / 0.2500 / 0.2500 | 2.500 / 2.500 / 2.500 | no gap (the oracle is not better) |" in md
    data = json.loads((tmp_path / "tiers" / "compare.json").read_text())
    assert data["arms"][ORACLE]["runs"]["0"]["by_tier"]["laptop"] == {"probe_acc": 0.4, "answer_loss": 1.5,
                                                                        "probes": 18, "noise": 0.0}
    # a tier's span inside its curves' round-to-round noise gets no closure, as the headline's does not
    noisy = ({"answer_loss": 3.0, "noise": 0.5}, {"answer_loss": 3.2, "noise": 0.5}, {"answer_loss": 2.9, "noise": 0.5})
    assert tier_closure(noisy) == "span within noise"  # 0.3 <= 2 sqrt(2) x 0.5
    assert tier_closure(tuple({**a, "noise": 0.01} for a in noisy)) == "0.67"
    bare = plan("quickstart", ["rounds=6"], [0], tmp_path / "bare")
    for arm in ARM_NAMES:
        write_run(bare.run_dir(arm, 0), bare.recipes[arm, 0], [3.0, 2.8, 2.7, 2.6])
    write_report(bare)
    assert "by the device tier" not in (tmp_path / "bare" / "compare.md").read_text()


def test_a_distill_smallest_only_is_read_from_its_family_rows(tmp_path):
    c = plan("distill", ["rounds=4"], [0], tmp_path)
    write_run(c.run_dir(SMALLEST, 0), c.recipes[SMALLEST, 0], [9.0, 9.0, 9.0, 9.0, 9.0],
              extra={"family_tiny_loss": 2.5, "family_tiny_ppl": 12.2})
    entry = collect_run(c.run_dir(SMALLEST, 0), c.arms[SMALLEST], c.metric)
    assert entry["key"] == "family_tiny_loss" and entry["final"] == 2.5 and entry["final_ppl"] == 12.2


# -- running: resume, interruption (a mock runner instead of Flower) ------------------------------------------------
class FakeRunner:
    """Stands in for ``fedfusion run``: records its arguments and leaves a finished run where ``--out`` says."""

    def __init__(self, comparison: Comparison, code: int = 0, interrupted: bool = False) -> None:
        self.c, self.code, self.interrupted, self.calls = comparison, code, interrupted, []

    def __call__(self, args, log, echo):
        self.calls.append(args)
        if self.code == 0 and not self.interrupted:
            out = Path(args[-1]) if args[1] != "--resume" else Path(args[2])
            arm, seed = out.name.rsplit("-s", 1)
            write_run(out, self.c.recipes[arm, int(seed)], [3.0, 2.9, 2.8, 2.7])
        return self.code, self.interrupted


def test_finished_runs_are_kept_a_checkpointed_one_resumes_and_one_without_a_checkpoint_starts_again(tmp_path):
    c = plan("quickstart", TINY, [0], tmp_path)
    write_run(c.run_dir(RECIPE, 0), c.recipes[RECIPE, 0], [3.0, 2.9, 2.8])  # finished
    stopped = c.run_dir(SMALLEST, 0)  # stopped after a checkpoint
    stopped.mkdir(parents=True)
    (stopped / "recipe.yaml").write_text(to_yaml(c.recipes[SMALLEST, 0]))
    (stopped / "checkpoint").mkdir()
    (stopped / "checkpoint" / "state.json").write_text("{}")
    (stopped / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    early = c.run_dir(ORACLE, 0)  # killed before its first checkpoint
    early.mkdir(parents=True)
    (early / "recipe.yaml").write_text(to_yaml(c.recipes[ORACLE, 0]))
    runner, said = FakeRunner(c), []
    assert execute(c, echo=said.append, runner=runner) == 0
    assert runner.calls == [["run", "--resume", str(stopped)], c.run_args(ORACLE, 0)]
    assert c.run_args(ORACLE, 0)[:2 + len(TINY)] == ["run", "quickstart", *TINY]
    assert c.run_args(ORACLE, 0)[-3:] == ["seed=0", "--out", str(early)]
    assert any("recipe seed 0: finished before, kept" in line for line in said)
    assert (tmp_path / "compare.md").is_file()
    again = FakeRunner(c)
    assert execute(c, echo=said.append, runner=again) == 0 and again.calls == []  # everything finished: report only


def test_a_run_directory_of_another_recipe_is_not_reused(tmp_path):
    c = plan("quickstart", TINY, [0], tmp_path)
    write_run(c.run_dir(RECIPE, 0), load_checked("quickstart", [*TINY, "train.lr=0.01"]), [3.0, 2.9, 2.8])
    with pytest.raises(FileExistsError, match=r"holds a run of another recipe \(train.lr: 0.01 there, 0.003 here\)"):
        execute(c, echo=lambda line: None, runner=FakeRunner(c))


def test_a_section_of_a_method_the_run_never_uses_does_not_make_it_another_recipe(tmp_path):
    """A submodel run reads no ``lora.*``: a finished run whose recipe differs only there is kept, while the same
    difference on a LoRA recipe is another recipe."""
    c = plan("quickstart", TINY, [0], tmp_path)
    write_run(c.run_dir(RECIPE, 0), load_checked("quickstart", [*TINY, "lora.alpha=4"]), [3.0, 2.9, 2.8])
    assert state(c.run_dir(RECIPE, 0), c.recipes[RECIPE, 0]) == "done"
    # nor does the units mode's section, which no run compare makes reads (a units default that changed since)
    write_run(c.run_dir(SMALLEST, 0), load_checked("quickstart", [*TINY, *c.arms[SMALLEST].overrides,
                                                                  "units.rejoin_after=0"]), [3.0, 2.9, 2.8])
    assert state(c.run_dir(SMALLEST, 0), c.recipes[SMALLEST, 0]) == "done"
    as_lora = ["fusion.method=lora", "data.source=chatterbot"]
    lora = load_recipe("rolling", as_lora)
    write_run(tmp_path / "lora", load_recipe("rolling", [*as_lora, "lora.alpha=4"]), [3.0, 2.9, 2.8])
    with pytest.raises(FileExistsError, match=r"lora.alpha: 4.0 there, 16.0 here"):
        state(tmp_path / "lora", lora)


def test_a_fusion_key_the_policy_never_reads_does_not_make_it_another_recipe(tmp_path):
    """``fusion.stagger`` is read by the rolling policy only: a static run (the oracle arm) that differs only there is
    kept, a rolling run that differs there is another recipe; and the build really ignores it outside rolling."""
    static = ["fusion.policy=static"]
    write_run(tmp_path / "static", load_recipe("rolling", [*static, "fusion.stagger=false"]), [3.0, 2.9, 2.8])
    assert state(tmp_path / "static", load_recipe("rolling", [*static, "fusion.stagger=true"])) == "done"
    write_run(tmp_path / "rolling", load_recipe("rolling", ["fusion.stagger=false"]), [3.0, 2.9, 2.8])
    with pytest.raises(FileExistsError, match=r"fusion.stagger: False there, True here"):
        state(tmp_path / "rolling", load_recipe("rolling", ["fusion.stagger=true"]))
    recipe = load_recipe("rolling", [*TINY, *static, "fusion.stagger=true"])
    assert {m.stagger for m in build_methods(recipe, lm_target(recipe)).values()} == {False}


def test_ctrl_c_stops_after_the_run_in_progress_and_keeps_the_finished_ones(tmp_path):
    c = plan("quickstart", TINY, [0], tmp_path)
    write_run(c.run_dir(RECIPE, 0), c.recipes[RECIPE, 0], [3.0, 2.9, 2.8])
    runner, said = FakeRunner(c, code=EXIT_INTERRUPTED, interrupted=True), []
    assert execute(c, echo=said.append, runner=runner) == EXIT_INTERRUPTED
    assert len(runner.calls) == 1 and (c.run_dir(RECIPE, 0) / "summary.json").is_file()
    assert "run the same command again to continue" in said[-1] and not (tmp_path / "compare.md").exists()
    failing = FakeRunner(c, code=1)
    assert execute(c, echo=said.append, runner=failing) == 1 and "failed (exit 1)" in said[-1]


# -- the CLI --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,says", [
    (["compare", "quickstart", "train.roundz=3"], "override 'train.roundz=3': bad key 'train.roundz'"),
    (["compare", "quickstart", "seed=3"], "seed: compare runs every arm at each of --seeds"),
    (["compare", "units"], "compare refuses 'units'"),
    (["compare", "quickstart", "--seeds", "1", "1"], "--seeds: give distinct seeds"),
])
def test_a_bad_recipe_or_argument_is_one_error_line_and_nothing_is_written(argv, says, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().out
    assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def shown_compare_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every concrete `fedfusion compare` command in the docs' code (synopses left out)."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"fedfusion compare [^`#\n]*", line):
                argv = shlex.split(m.group(0))[1:]
                if not any(re.fullmatch(r"[A-Z][A-Z0-9_]*|\[.*|\.\.\.\]?", a) for a in argv[1:]):
                    found.append((f"{doc.name}:{number}", argv))
    return found


COMPARE_COMMANDS = shown_compare_commands()


def test_the_docs_show_a_compare_command():
    assert COMPARE_COMMANDS


@pytest.mark.usefixtures("smollm2_config_dir")  # the finetune recipe's target, without its GGUF package
@pytest.mark.parametrize("where,argv", COMPARE_COMMANDS, ids=[w for w, _ in COMPARE_COMMANDS])
def test_a_shown_compare_command_plans_its_arms(where, argv, tmp_path):
    """Every `fedfusion compare` the docs show parses and its arms resolve and share the budget (nothing runs)."""
    args = parser().parse_args(argv)
    overrides = []
    for item in args.overrides:  # a user's facts files, stood in as `fedfusion facts` writes them
        key, _, value = item.partition("=")
        if key in ("data.path", "data.probes"):
            from fedfusion.data.facts import write_facts

            clients = next((int(o.split("=")[1]) for o in args.overrides if o.startswith("population.num_clients=")), 16)
            paths = write_facts(tmp_path / "facts", clients, 2 * clients, seed=0)
            item = f"{key}={paths['train' if key == 'data.path' else 'probes']}"
        overrides.append(item)
    plan(args.recipe, overrides, args.seeds, tmp_path / "out", args.arms)


@pytest.mark.slow  # Flower's simulation engine: one tiny run, then the same command again
def test_compare_runs_an_arm_through_flower_and_the_same_command_then_only_reports(tmp_path, capsys):
    out = tmp_path / "cmp"
    # the smallest-only arm trains submodel slices: stateless nodes, one Ray actor (tests/ray_actors.py)
    argv = ["compare", "quickstart", *TINY, ONE_ACTOR, "--seeds", "0", "--arms", "smallest-only", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "smallest-only-s0" / "summary.json").read_text())
    assert summary["status"] == "ok"
    recipe = load_recipe(out / "smallest-only-s0" / "recipe.yaml")
    assert recipe.fusion.grow_round == 2 and recipe.fusion.policy == "static" and recipe.seed == 0
    data = json.loads((out / "compare.json").read_text())
    assert len(data["arms"]["smallest-only"]["runs"]["0"]["curve"]) == 3
    capsys.readouterr()
    assert main(argv) == 0
    assert "finished before, kept" in capsys.readouterr().out


@pytest.mark.slow  # Flower's simulation engine: one tiny run, stopped after its first round
def test_sigterm_to_compare_alone_stops_its_run_at_a_checkpoint_and_leaves_no_process(tmp_path):
    """What a scheduler or `timeout` does: SIGTERM to the compare process only (not its group, as a terminal's
    Ctrl-C would). Compare passes it on; the run stops at its next safe point with `status: interrupted`; compare
    exits 130 naming the same command; no process of either is left."""
    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "fedfusion.cli", "compare", "quickstart", *TINY, ONE_ACTOR, "rounds=30", "--seeds", "0",
            "--arms", "smallest-only", "--out", str(out)]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = out / "smallest-only-s0"
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not (run / "checkpoint" / "state.json").is_file():
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, output
        assert "run the same command again to continue" in output and "Traceback" not in output, output
        assert session_members(proc.pid) == [], output
    finally:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_round"] < 30, summary
