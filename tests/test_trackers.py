"""output.tracker: the rows metrics.jsonl gets also reach the tracker (a fake one, TensorBoard's event files, an
MLflow file store)."""

from __future__ import annotations

import numpy
import pytest

import fedfusion.run.run_dir
from fedfusion.analysis.report import read_jsonl
from fedfusion.config.sections import RecipeError
from fedfusion.run.check import load_checked
from fedfusion.run.run_dir import RunDir
from fedfusion.run.trackers import scalars

ROWS = [{"round": 0, "eval_loss": 4.6, "train_loss": None, "void": False, "clients_ok": 0},
        {"round": 1, "eval_loss": 3.1, "train_loss": 3.4, "void": True, "clients_ok": 6, "name": "text"},
        {"round": 2, "eval_loss": 2.9, "train_loss": float("nan"), "void": False, "clients_ok": 5}]


def test_every_metrics_row_reaches_the_tracker_as_written_and_the_summary_closes_it(tmp_path, monkeypatch):
    seen, closed = [], []

    class Fake:
        def log(self, row):
            seen.append(dict(row))

        def close(self, status):
            closed.append(status)

    monkeypatch.setattr(fedfusion.run.run_dir, "open_tracker",
                        lambda name, path, experiment: Fake() if (name, experiment) == ("tensorboard", "quickstart") else None)
    run = RunDir(tmp_path / "run", load_checked("quickstart", ["output.tracker=tensorboard"]))
    for row in ROWS[:2]:
        run.log_round(row)
    assert seen == read_jsonl(run.path / "metrics.jsonl") == ROWS[:2]
    run.write_summary({"status": "interrupted"})
    assert closed == ["interrupted"]


def test_without_a_tracker_nothing_is_opened(tmp_path, monkeypatch):
    monkeypatch.setattr(fedfusion.run.run_dir, "open_tracker", lambda *a: pytest.fail("no tracker was asked for"))
    RunDir(tmp_path / "run", load_checked("quickstart")).log_round(ROWS[0])


def test_scalars_keep_numbers_and_booleans_and_drop_none_nan_text_and_the_step():
    assert scalars(ROWS[1]) == {"eval_loss": 3.1, "train_loss": 3.4, "void": 1.0, "clients_ok": 6.0}
    assert scalars(ROWS[2]) == {"eval_loss": 2.9, "void": 0.0, "clients_ok": 5.0}


def test_tensorboard_event_files_hold_each_rows_scalars_at_its_round(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "run", load_checked("quickstart", ["output.tracker=tensorboard"]))
    for row in ROWS:
        run.log_round(row)
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("eval_loss")
    assert [e.step for e in loss] == [0, 1, 2]
    # TensorBoard stores a scalar as float32: the value read back is the row's rounded to nearest float32, exactly
    assert all(e.value == float(numpy.float32(r["eval_loss"])) for e, r in zip(loss, ROWS))
    assert [e.step for e in events.Scalars("train_loss")] == [1]  # None and NaN rows are not logged
    assert "name" not in events.Tags()["scalars"]


@pytest.mark.slow  # importing mlflow takes seconds
def test_mlflow_gets_one_run_per_run_directory_with_each_rows_metrics_at_its_round(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store for the test; users name their server
    run = RunDir(tmp_path / "run-a", load_checked("quickstart", ["output.tracker=mlflow"]))
    for row in ROWS:
        run.log_round(row)
    run.write_summary({"status": "ok"})
    client = MlflowClient()
    found = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert [(r.info.run_name, r.info.status) for r in found] == [("run-a", "FINISHED")]
    history = client.get_metric_history(found[0].info.run_id, "eval_loss")
    assert sorted((m.step, m.value) for m in history) == [(r["round"], r["eval_loss"]) for r in ROWS]
    assert [m.step for m in client.get_metric_history(found[0].info.run_id, "train_loss")] == [1]


def test_an_unknown_or_missing_tracker_is_a_recipe_error(monkeypatch):
    with pytest.raises(RecipeError, match="output.tracker: 'wandb' is not one of none, tensorboard, mlflow"):
        load_checked("quickstart", ["output.tracker=wandb"])
    monkeypatch.setattr("fedfusion.run.check.find_spec", lambda name: None)
    with pytest.raises(RecipeError, match=r"output.tracker: tensorboard is not installed: pip install 'fedfusion\[tracking\]'"):
        load_checked("quickstart", ["output.tracker=tensorboard"])
