"""`fedfusion plan` and `fedfusion report` (the run path is covered by test_simulation)."""

from __future__ import annotations

import json
from pathlib import Path

from fedfusion.cli import main
from fedfusion.planner import llama_params, plan_table
from fedfusion.recipe import load_recipe


def test_plan_lists_every_tier_with_its_slice(capsys):
    assert main(["plan", "quickstart"]) == 0
    out = capsys.readouterr().out
    for tier in ("phone", "laptop", "desktop"):
        assert tier in out
    rows = plan_table(load_recipe("quickstart"))
    assert [r["width"] for r in rows] == [0.125, 0.25, 0.5]
    assert rows[0]["params"] < rows[1]["params"] < rows[2]["params"]
    assert all(r["fits"] == "yes" for r in rows)


def test_devices_lists_the_catalog(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cloud-a100" in out and "phone-lowend" in out


def test_param_count_matches_a_real_model():
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_config

    cfg = tiny_config(heads=8, kv_heads=2)
    assert llama_params(cfg) == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


def fake_run(path: Path, losses: list[float]) -> Path:
    path.mkdir(parents=True)
    rows = [{"round": i, "eval_loss": v, "eval_ppl": 2.718 ** v, "eval_acc": 0.1 * i} for i, v in enumerate(losses)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"status": "ok", "wall_s": 1.0}))
    return path


def test_report_compares_several_runs(tmp_path):
    a, b = fake_run(tmp_path / "rolling", [4.0, 3.0, 2.5]), fake_run(tmp_path / "static", [4.0, 3.2, 3.1])
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "| rolling | ok | 2 | 2.5000" in text and "| static | ok | 2 | 3.1000" in text
    assert (tmp_path / "cmp" / "plots" / "loss_vs_cost.png").is_file()
    assert (tmp_path / "cmp" / "plots" / "eval_loss.png").stat().st_size > 1000


def test_report_on_a_non_run_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().out


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    from fedfusion.run_dir import RunDir

    run = RunDir(tmp_path / "done", load_recipe("quickstart", ["rounds=2"]))
    (run.path / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "eval_loss": 4.0 - r}) + "\n"
                                                    for r in range(3)))
    (run.path / "checkpoint").mkdir()
    (run.path / "checkpoint" / "state.json").write_text(json.dumps({"round": 2, "elapsed_s": 9.0, "strategy": {}}))
    (run.path / "report.md").write_text("# Run report\n")
    run.write_summary({"status": "ok", "rounds": 2, "wall_s": 12.5})
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.path.rglob("*") if p.is_file()}
    assert main(["run", "--resume", str(run.path)]) == 0
    assert "already finished" in capsys.readouterr().out
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.path.rglob("*") if p.is_file()} == before
