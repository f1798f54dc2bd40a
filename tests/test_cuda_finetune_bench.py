"""benchmarks/cuda_finetune.py on the CPU: compare's plan and report over runs of the in-process driver."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cuda_finetune  # noqa: E402

from fedfusion.run.arms import ARM_NAMES  # noqa: E402


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_arm_runs_in_process_and_compare_reports_them(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    args = ["quickstart", "rounds=3", "train.local_steps=1", "train.eval_every=2", "--seeds", "0", "--device", "cpu",
            "--jobs", "2", "--work", str(work), "--results", str(results), "--stem", "bench"]
    assert cuda_finetune.main(args) == 0
    firsts = set()
    for arm in ARM_NAMES:
        run = work / f"{arm}-s0"
        rows = _rows(run)
        assert [r["round"] for r in rows] == [0, 2, 3]  # round 0, every eval_every-th, the last
        firsts.add(rows[0]["eval_loss"])
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["driver"] == cuda_finetune.DRIVER
        assert summary["client_rounds"] == 3 * 6  # rounds x the quickstart's clients per round, all trained
    assert len(firsts) == 1  # every arm starts from the same target
    report = (results / "bench.md").read_text()
    assert "ran in process" in report and "x86_64 CPU" in report and "](bench.png)" in report
    assert "`fedfusion run` in" not in report and (results / "bench.png").is_file()
    data = json.loads((results / "bench.json").read_text())
    assert set(data["arms"]) == set(ARM_NAMES)
    assert data["command"].startswith("python benchmarks/cuda_finetune.py quickstart rounds=3")
    # the same command again keeps the finished runs; --report-only rewrites the report from them alone
    stamps = {arm: (work / f"{arm}-s0" / "summary.json").stat().st_mtime_ns for arm in ARM_NAMES}
    assert cuda_finetune.main(args) == 0
    assert cuda_finetune.main([*args, "--report-only"]) == 0
    assert {arm: (work / f"{arm}-s0" / "summary.json").stat().st_mtime_ns for arm in ARM_NAMES} == stamps
    assert json.loads((results / "bench.json").read_text())["command"] == data["command"]
    # a run cut short is run again; a run another tool made is refused, not reported as this script's
    (work / "oracle-s0" / "summary.json").unlink()
    assert cuda_finetune.main(args) == 0 and [r["round"] for r in _rows(work / "oracle-s0")] == [0, 2, 3]
    again = json.loads((work / "oracle-s0" / "summary.json").read_text())
    first = json.loads((results / "bench.json").read_text())["arms"]["oracle"]["runs"]["0"]["final"]
    assert again["driver"] == cuda_finetune.DRIVER and _rows(work / "oracle-s0")[-1]["eval_loss"] == first  # seeded
    summary = json.loads((work / "recipe-s0" / "summary.json").read_text())
    (work / "recipe-s0" / "summary.json").write_text(json.dumps({**summary, "driver": "fedfusion run"}))
    with pytest.raises(FileExistsError, match="did not make"):
        cuda_finetune.main(args)


@pytest.mark.slow
def test_a_failed_run_is_reported_and_leaves_the_results_untouched(tmp_path, monkeypatch):
    results = tmp_path / "results"
    args = ["quickstart", "rounds=1", "train.local_steps=1", "--seeds", "0", "--device", "no-such-device",
            "--jobs", "0", "--work", str(tmp_path / "work"), "--results", str(results)]  # in this process
    assert cuda_finetune.main(args) == 1
    summary = json.loads((tmp_path / "work" / "recipe-s0" / "summary.json").read_text())
    assert summary["status"] == "failed" and "no-such-device" in summary["error"]
    assert not results.exists()


@pytest.mark.parametrize(("recipe", "overrides", "named"), [
    ("knowledge", [], "width slicing only"), ("quickstart", ["privacy.mode=clip"], "privacy"),
    ("quickstart", ["selection.overselect=0.5"], "selection"), ("quickstart", ["fusion.policy=owned"], "owned")])
def test_a_recipe_the_driver_cannot_run_is_refused_before_anything_runs(tmp_path, recipe, overrides, named):
    with pytest.raises(SystemExit, match=named):
        cuda_finetune.main([recipe, *overrides, "--seeds", "0", "--device", "cpu", "--work", str(tmp_path / "w"),
                            "--results", str(tmp_path / "r")])
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()
