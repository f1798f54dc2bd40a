"""Checkpoints: atomic save/load, ledgers cut back on resume, and a restored strategy samples as before."""

from __future__ import annotations

import json
import random

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedfusion.analysis.report import read_jsonl
from fedfusion.cli import main
from fedfusion.config.recipe import load_recipe
from fedfusion.fusion.state import load_optimizer_state, optimizer_state, rng_state, set_rng_state
from fedfusion.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedfusion.run.run_dir import RunDir
from tests.test_strategy import FakeGrid, make_strategy, plans, task_identity  # noqa: F401 (autouse fixture)


def test_checkpoint_round_trips_target_and_state(tmp_path):
    target = {"a": torch.randn(3, 4), "b": torch.arange(5.0)}
    save_checkpoint(tmp_path, Checkpoint(round=3, target=target, elapsed_s=1.5, strategy={"k": [1, 2]}))
    save_checkpoint(tmp_path, Checkpoint(round=4, target=target, elapsed_s=2.5, strategy={"k": [3]}))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.round == 4 and ckpt.elapsed_s == 2.5 and ckpt.strategy == {"k": [3]}
    assert all(torch.equal(ckpt.target[k], target[k]) for k in target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no temporaries left behind


def test_a_kill_between_the_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(round=2, target={"a": torch.ones(2)}))
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    assert load_checkpoint(tmp_path).round == 2


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path)


def test_rng_state_survives_json():
    rng = random.Random(7)
    rng.random()
    saved = json.loads(json.dumps(rng_state(rng)))
    expected = [rng.random() for _ in range(5)]
    other = random.Random(0)
    set_rng_state(other, saved)
    assert [other.random() for _ in range(5)] == expected


def test_cut_ledgers_drops_rows_after_the_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run", load_recipe("quickstart"))
    run.log_round({"round": 0})
    run.log_round({"round": 1})
    run.log_round({"round": 2})
    run.log_clients([{"round": 1, "node": 5}, {"round": 2, "node": 6}])
    reopened = RunDir.reopen(run.path)
    reopened.cut_ledgers(1)
    assert [r["round"] for r in read_jsonl(run.path / "metrics.jsonl")] == [0, 1]
    assert read_jsonl(run.path / "clients.jsonl") == [{"round": 1, "node": 5}]
    assert reopened.recipe == run.recipe


def test_a_restored_strategy_samples_and_slices_like_the_uninterrupted_one():
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone", 14: "phone", 15: "desktop"})
    straight, state = make_strategy()
    for rnd in (1, 2):
        list(straight.configure_train(rnd, ArrayRecord(state), ConfigRecord({}), grid))
    saved = json.loads(json.dumps(straight.run.state_dict()))
    third = list(straight.configure_train(3, ArrayRecord(state), ConfigRecord({}), grid))

    resumed, _ = make_strategy()
    resumed.run.load_state_dict(saved, rounds_done=2)
    again = list(resumed.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))  # Flower restarts at 1
    assert [m.metadata.dst_node_id for m in again] == [m.metadata.dst_node_id for m in third]
    assert [m.content["config"]["seed"] for m in again] == [m.content["config"]["seed"] for m in third]
    assert all(m.content["config"]["server-round"] == 3 for m in again)
    assert plans(resumed) == plans(straight)


def test_resume_refuses_a_recipe_or_overrides(tmp_path, capsys):
    assert main(["run", "quickstart", "--resume", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().out
    assert main(["run", "--resume", str(tmp_path)]) == 2  # not a run directory
    assert "recipe.yaml" in capsys.readouterr().out


def test_a_resumed_runs_earlier_parts_count_from_their_summary_or_else_their_last_checkpoint(tmp_path):
    from fedfusion.run.lifecycle import earlier_wall_s

    run = RunDir(tmp_path / "r", load_recipe("rolling", ["rounds=3"]))
    ckpt = Checkpoint(round=1, target={}, elapsed_s=30.0)
    assert earlier_wall_s(run, ckpt) == 30.0  # killed outright: no summary, the time up to its checkpoint
    run.write_summary({"status": "interrupted", "wall_s": 50.0})
    assert earlier_wall_s(run, ckpt) == 50.0  # stopped by Ctrl-C: everything up to the stop


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_an_optimizer_saved_in_a_checkpoint_steps_on_as_the_original(tmp_path, name):
    """A units run's optimizer: its groups in state.json, its moments in tensors.safetensors; restored into a fresh
    optimizer over a copy of the parameters, the next step is the original's to the bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    make = (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)) if name == "adamw" else (
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1))
    opt = make(model.parameters())

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
        o.zero_grad()
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        o.step()

    step(model, opt, 1)
    groups, moments = optimizer_state(opt)
    save_checkpoint(tmp_path, Checkpoint(round=1, target=dict(model.state_dict()), strategy=groups, tensors=moments))
    ckpt = load_checkpoint(tmp_path)
    copy = torch.nn.Linear(4, 3)
    copy.load_state_dict(ckpt.target)
    restored = make(copy.parameters())
    load_optimizer_state(restored, ckpt.strategy, ckpt.tensors)
    step(model, opt, 2)
    step(copy, restored, 2)
    for a, b in zip(model.parameters(), copy.parameters()):
        assert torch.equal(a, b)
