"""benchmarks/cuda_finetune.py on the CPU: compare's plan and report over runs of the in-process driver."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cuda_finetune  # noqa: E402

from fedfusion.run.arms import ARM_NAMES  # noqa: E402


@pytest.mark.slow
def test_every_arm_runs_in_process_and_compare_reports_them(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    args = ["quickstart", "rounds=2", "train.local_steps=1", "train.eval_every=1", "--seeds", "0", "--device", "cpu",
            "--jobs", "2", "--work", str(work), "--results", str(results), "--stem", "bench"]
    assert cuda_finetune.main(args) == 0
    for arm in ARM_NAMES:
        run = work / f"{arm}-s0"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2] and all(r["eval_loss"] > 0 for r in rows)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["client_rounds"] > 0 and summary["device"].endswith("CPU")
    report = (results / "bench.md").read_text()
    assert "ran in process" in report and "](bench.png)" in report and "`fedfusion run` in" not in report
    data = json.loads((results / "bench.json").read_text())
    assert set(data["arms"]) == set(ARM_NAMES) and all(data["arms"][a]["runs"]["0"]["final"] > 0 for a in ARM_NAMES)
    assert data["command"].startswith("python benchmarks/cuda_finetune.py quickstart rounds=2")
    # a second call keeps the finished runs; --report-only rewrites the report from them alone
    mtime = (work / "recipe-s0" / "summary.json").stat().st_mtime_ns
    assert cuda_finetune.main([*args, "--report-only"]) == 0
    assert (work / "recipe-s0" / "summary.json").stat().st_mtime_ns == mtime
    assert json.loads((results / "bench.json").read_text())["command"] == data["command"]


@pytest.mark.parametrize(("recipe", "overrides", "named"), [
    ("knowledge", [], "width-slicing recipes only"), ("quickstart", ["privacy.mode=clip"], "privacy"),
    ("quickstart", ["selection.method=oort"], "selection.method=oort")])
def test_a_recipe_the_driver_cannot_run_is_refused_before_anything_runs(tmp_path, recipe, overrides, named):
    with pytest.raises(SystemExit, match=named):
        cuda_finetune.main([recipe, *overrides, "--seeds", "0", "--device", "cpu", "--work", str(tmp_path / "w"),
                            "--results", str(tmp_path / "r")])
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()
