"""End to end on Flower's simulation engine (Ray): a tiny recipe through the real CLI path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedfusion.analysis.report import read_jsonl
from fedfusion.cli import main
from fedfusion.devices.hardware import status_kb
from fedfusion.fusion.rounds import client_steps
from tests.processes import running, session_members
from tests.ray_actors import ONE_ACTOR, TWO_ACTORS

pytestmark = pytest.mark.slow  # Flower's runtime (Ray or SuperLink processes): minutes, not seconds
# the tests of the module's one tiny run (run_dir) stay on one pytest-xdist worker (addopts: --dist loadgroup), so
# that the run is made once, not once per worker
ON_THE_TINY_RUN = pytest.mark.xdist_group("test_simulation.run_dir")

# the TINY runs' clients on one Ray actor (tests/ray_actors.py): their roles keep nothing on their nodes; the run
# with secure aggregation asks for two again (its nodes' secrets live in context.state between its steps)
TINY = [
    "rounds=2", "population.num_clients=4", "selection.clients_per_round=3", "selection.evaluate_clients=1",
    "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=64",
    "model.num_layers=1", "train.local_steps=2", "train.batch_size=4", "train.seq_len=32",
    "data.eval_chars=3000", ONE_ACTOR,
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["run", "rolling", *TINY, "--out", str(out)]) == 0
    return out


@ON_THE_TINY_RUN
def test_run_directory_has_every_output(run_dir):
    for name in ("recipe.yaml", "metrics.jsonl", "clients.jsonl", "summary.json", "report.md",
                 "plots/eval_loss.png", "model/config.json", "model/tokenizer.json"):
        assert (run_dir / name).is_file(), name


@ON_THE_TINY_RUN
def test_nodes_ledger_holds_each_nodes_measured_capabilities(run_dir):
    nodes = read_jsonl(run_dir / "nodes.jsonl")
    assert sorted(n["partition"] for n in nodes) == [0, 1, 2, 3]
    assert all(n["memory_gb"] > 0 and n["accelerator"] in ("cpu", "cuda", "mps") and n["examples"] > 0 for n in nodes)


@ON_THE_TINY_RUN
def test_metrics_rows_start_at_round_zero_and_carry_the_contract_fields(run_dir):
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert {"eval_loss", "eval_ppl", "eval_acc", "bytes_down", "bytes_up", "clients_ok",
                "clients_failed", "wall_s"} <= set(row)
    assert all(r["clients_ok"] == 3 and r["bytes_down"] > 0 for r in rows[1:])
    assert all(r["fed_eval_loss"] > 0 for r in rows[1:])  # one client scored the target on its held-out text
    for row in rows[1:]:  # the energy ledger: priced from counted work on the clients' device profiles
        assert row["energy_j"] > 0 and row["co2_g"] > 0 and row["virtual_s"] > 0 and row["wasted_j"] == 0


@ON_THE_TINY_RUN
def test_clients_rows_record_each_client_and_its_slice(run_dir):
    rows = read_jsonl(run_dir / "clients.jsonl")
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"}
    widths = json.loads(json.dumps({"phone": 0.125, "laptop": 0.25, "desktop": 0.5}))
    for row in rows:
        assert row["width"] == widths[row["device"]]
        assert row["bytes_up"] == row["bytes_down"] > 0  # a client sends back exactly its sub-model
        assert row["energy_j"] > 0 and row["virtual_s"] >= row["compute_s"] > 0 and not row["wasted"]
        assert row["tokens"] == 2 * 4 * 32 and row["params"] > 0


@ON_THE_TINY_RUN
def test_summary_and_saved_target_load_with_transformers(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final"]["eval_loss"] < summary["initial"]["eval_loss"]
    # the server process's peak (the run ran in this test process): torch alone holds more than 100 MiB, and a peak
    # then cannot exceed this process's peak now (VmHWM only grows); a kB figure read as MiB would be 1024x over
    assert 100 <= summary["server_peak_rss_mb"] <= status_kb("VmHWM") / 1024
    assert f"the server process's peak resident memory {summary['server_peak_rss_mb']:,.0f} MiB" in (
        run_dir / "report.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tok = AutoTokenizer.from_pretrained(run_dir / "model")
    ids = tok("To be", return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 8
    assert isinstance(tok.decode(out[0]), str)
    assert sum(p.numel() for p in model.parameters()) == summary["target_params"]


def test_bad_recipe_exits_nonzero_and_writes_no_run(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["run", "quickstart", "fusion.policy=sideways", "--out", str(out)]) == 2
    assert "fusion.policy" in capsys.readouterr().out
    assert not out.exists()


def test_a_cap_on_local_epochs_gives_each_client_its_own_steps_and_the_ledger_prices_them(tmp_path):
    out = tmp_path / "capped"
    assert main(["run", "rolling", *TINY, "selection.evaluate_clients=0", "train.local_steps=40",
                 "train.max_epochs=0.05", "--out", str(out)]) == 0
    clients = read_jsonl(out / "clients.jsonl")
    # each client reports the tokens it trained: ceil(0.05 x windows / 4) steps of 4 x 32, not 40 steps
    steps = [client_steps(40, 4, 0.05, c["examples"]) for c in clients]
    assert {c["status"] for c in clients} == {"ok"} and max(steps) < 40
    assert [c["tokens"] for c in clients] == [s * 4 * 32 for s in steps]


def test_clients_that_all_crash_leave_the_target_unchanged_and_the_run_completes(tmp_path):
    out = tmp_path / "crashing"
    assert main(["run", "rolling", *TINY, "selection.evaluate_clients=0", "faults.crash_prob=1.0",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["clients_ok"] == 0 and summary["clients_failed"] == 6
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["void"] for r in rows[1:])
    assert rows[-1]["eval_loss"] == rows[0]["eval_loss"]  # nothing was folded in
    assert rows[-1]["wasted_j"] == rows[-1]["energy_j"] > 0  # the crashed work still cost energy
    clients = read_jsonl(out / "clients.jsonl")
    assert {c["status"] for c in clients} == {"failed"} and all("injected crash" in c["error"] for c in clients)


# a straggler's sleep in test_over_selection: it was 30 s; round 2 closes at its quorum in ~0.2 s on a loaded 2-core
# host, so 10 s is still 40x past that, and the run (which does not end before the stragglers wake) is ~45 s shorter
STRAGGLE_S = 10.0


def test_over_selection_closes_rounds_without_waiting_for_stragglers(tmp_path):
    """1 of 2 clients needed, both sampled; one of them straggles in each round (the seeded draws: partition 0
    in round 1, partition 1 in round 2) and sleeps STRAGGLE_S after training: a round with warm actors closes at the
    quorum of 1 update, well before it, and the client not waited for is recorded as cut. Round 1 only has to
    stay consistent: actors start up unevenly, so on a loaded machine who finishes first there is timing."""
    out = tmp_path / "overselect"
    assert main(["run", "rolling", *TINY, "population.num_clients=2", "selection.evaluate_clients=0",
                 "selection.clients_per_round=1", "selection.overselect=1.0",
                 "faults.straggler_prob=0.5", f"faults.straggler_delay_s={STRAGGLE_S}",
                 "engine.cpus_per_client=0.5", "--out", str(out)]) == 0  # 4 actors: a sleeper never blocks a round
    clients = read_jsonl(out / "clients.jsonl")
    for rnd in (1, 2):
        statuses = [c["status"] for c in clients if c["round"] == rnd]
        assert len(statuses) == 2 and "ok" in statuses and set(statuses) <= {"ok", "cut"}
    assert {c["partition"]: c["status"] for c in clients if c["round"] == 2} == {0: "ok", 1: "cut"}
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["clients_ok"] >= 1 for r in rows[1:])
    assert rows[2]["clients_cut"] == 1 and rows[2]["wasted_j"] > 0
    assert rows[2]["wall_s"] < STRAGGLE_S  # closed at the quorum, not at the straggler's reply


@ON_THE_TINY_RUN
def test_the_saved_recipe_reruns_the_same_and_a_run_killed_mid_way_resumes_to_the_same_result(run_dir, tmp_path):
    """The run's own recipe.yaml, started again and killed during round 2, then resumed: every round and
    every client row equals the uninterrupted run's (one Flower run covers both reproducibility paths)."""
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "fedfusion.cli", "run", str(run_dir / "recipe.yaml"), "--out", str(out)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, deadline = out / "checkpoint" / "state.json", time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline and not state.is_file():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI, Ray and its workers, mid-way through round 2
    proc.wait()
    assert json.loads(state.read_text())["round"] == 1
    assert not (out / "summary.json").exists()  # it really was interrupted
    assert main(["run", "--resume", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    first, resumed = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in resumed] == [0, 1, 2]
    assert [r["eval_loss"] for r in resumed] == [r["eval_loss"] for r in first]
    keys = ("round", "device", "width", "assignment", "partition", "status", "examples", "train_loss",
            "bytes_down", "bytes_up", "params", "tokens", "energy_j", "co2_g")  # not node ids or host seconds
    pick = lambda rows: [{k: r[k] for k in keys} for r in rows]  # noqa: E731
    assert pick(read_jsonl(out / "clients.jsonl")) == pick(read_jsonl(run_dir / "clients.jsonl"))


@ON_THE_TINY_RUN
def test_one_ctrl_c_stops_the_run_cleanly_and_resume_then_matches_the_uninterrupted_run(run_dir, tmp_path):
    """One SIGINT to the run's process group (what Ctrl-C in a terminal sends) once round 1 is checkpointed:
    the run stops within 10 s with exit 130, no process of it is left, summary.json says interrupted after
    round 1 and the output names the resume command; the resume ends equal to the uninterrupted run, and its
    wall time adds both parts."""
    out = tmp_path / "ctrl-c"
    proc = subprocess.Popen([sys.executable, "-m", "fedfusion.cli", "run", str(run_dir / "recipe.yaml"), "--out", str(out)],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        state, deadline = out / "checkpoint" / "state.json", time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline and not state.is_file():
            time.sleep(0.05)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        assert spawned  # Ray's processes
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - sent
        print(f"stopped {stopped_s:.1f} s after SIGINT; output:\n{output}")
        assert proc.returncode == 130, output
        assert stopped_s <= 10, output
        assert not [p for p in spawned if running(p)]
        assert session_members(proc.pid) == []
    finally:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_round"] == summary["resume_after"] == 1, summary
    assert f"fedfusion run --resume {out}" in output and "Traceback" not in output, output
    assert [r["round"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
    started = time.monotonic()
    assert main(["run", "--resume", str(out)]) == 0
    part_s = time.monotonic() - started
    resumed = json.loads((out / "summary.json").read_text())
    first, again = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    # wall time = the interrupted part + the resumed part (which took at least its round and at most the call)
    assert resumed["status"] == "ok"
    assert summary["wall_s"] + again[2]["wall_s"] <= resumed["wall_s"] <= summary["wall_s"] + part_s
    assert [r["round"] for r in again] == [0, 1, 2]
    assert [r["eval_loss"] for r in again] == [r["eval_loss"] for r in first]
    assert resumed["final"] == json.loads((run_dir / "summary.json").read_text())["final"]


def test_gpt2_ordered_slicing_with_energy_selection_and_availability_runs_on_flower(tmp_path):
    out = tmp_path / "avail"
    assert main(["run", "rolling", *TINY, "rounds=3", "selection.evaluate_clients=0", "selection.method=energy",
                 "availability.enabled=true", "availability.start_clock_s=28800", "model.family=gpt2",
                 "model.num_layers=3", "fusion.axes=[heads,neurons,hidden,depth]", "fusion.policy=ordered",
                 "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    clocks = [r["clock_s"] for r in rows[1:]]
    assert clocks[0] == 28800 and clocks == sorted(clocks) and clocks[-1] > clocks[0]
    statuses = {c["status"] for c in read_jsonl(out / "clients.jsonl")}
    assert statuses <= {"ok", "dropped"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropouts"] == sum(r["dropouts"] for r in rows) and 0 <= summary["participation_jain"] <= 1
    assert "## Edge vs cloud" in (out / "report.md").read_text()
    assert AutoModelForCausalLM.from_pretrained(out / "model").config.model_type == "gpt2"
    sliced = [c["assignment"] for c in read_jsonl(out / "clients.jsonl") if c["status"] == "ok"]
    assert sliced and all({"hidden", "layers"} <= set(a) for a in sliced)


def test_distillation_recipe_runs_on_flower_and_prices_the_server(tmp_path):
    out = tmp_path / "distill"
    tiny_families = ("distill.families={a: {hidden_size: 16, num_layers: 1, num_heads: 2}, "
                     "b: {model_type: gpt2, hidden_size: 16, num_layers: 1, num_heads: 2, tokenizer: bpe, "
                     "bpe_vocab: 300}}")
    assert main(["run", "distill", *TINY, "selection.evaluate_clients=0", tiny_families,
                 "distill.tier_family={phone: a, laptop: b, desktop: b}", "distill.server_steps=2",
                 "distill.back_steps=1", "distill.transfer.max_chars=6000", "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["clients_ok"] == 3 and r["server_flops"] > 0 and r["server_energy_j"] > 0 for r in rows[1:])
    trained = {f for r in rows[1:] for f in ("a", "b") if f"family_{f}_loss" in r}
    assert trained and all(f"family_{f}_{'acc' if f == 'a' else 'token_acc'}" in rows[-1] for f in trained)
    clients = read_jsonl(out / "clients.jsonl")
    assert {c["assignment"]["family"] for c in clients} <= {"a", "b"}
    assert {c["status"] for c in clients} == {"ok"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final"]["eval_loss"] < summary["initial"]["eval_loss"]
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize("secure", [False, True])
def test_lora_recipe_runs_on_flower_with_heterogeneous_ranks(tmp_path, secure):
    """Heterogeneous ranks through Flower's simulation; with secure aggregation every reply is a masked vector of one
    length a round (the dense update's change: flexlora), whatever rank its client trained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedfusion.data.text import build_char_tokenizer

    base = tmp_path / "tiny-base"
    tok = build_char_tokenizer()
    torch_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id))
    torch_model.save_pretrained(base)
    tok.save_pretrained(base)
    out = tmp_path / "lora"
    assert main(["run", "rolling", *TINY, "selection.evaluate_clients=0", "fusion.method=lora",
                 "data.source=chatterbot", f"lora.base={base}", "lora.ranks={phone: 2, laptop: 4, desktop: 8}",
                 "lora.quantize={phone: 0, laptop: 0, desktop: 0}", "lora.method=flexlora", "lora.eval_pairs=20",
                 "train.seq_len=96", "train.local_steps=3", f"privacy.secure_aggregation={str(secure).lower()}",
                 *([TWO_ACTORS] if secure else []), "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["clients_ok"] == 3 for r in rows[1:])
    clients = read_jsonl(out / "clients.jsonl")
    if secure:
        assert all(c["secagg_bytes"] > 0 for c in clients)
        for round_ in {c["round"] for c in clients}:
            assert len({c["bytes_up"] for c in clients if c["round"] == round_}) == 1
    ranks = {"phone": 2, "laptop": 4, "desktop": 8}
    assert all(c["rank"] == ranks[c["device"]] and c["status"] == "ok" for c in clients)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not (out / "model").exists()  # the merged base only with output.save_merged
    assert json.loads((out / "summary.json").read_text())["metric_names"]["eval_acc"] == "next-token accuracy (response tokens)"
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]


def test_lora_learns_facts_on_a_pretrained_base_through_flower(tmp_path):
    """``fusion.method=lora`` on the finetune recipe's facts: each tier's adapter rank on the base the facts are
    tokenised for, the documents' token windows trained with the language-model loss, and the target (base + global
    update) scored on every client's probes and on general text, as the window recipe's target is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedfusion.data.text import build_char_tokenizer

    base = tmp_path / "tiny-base"
    tok = build_char_tokenizer()
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)).save_pretrained(base)
    tok.save_pretrained(base)
    out = tmp_path / "lora-facts"
    assert main(["run", "finetune", "fusion.method=lora", "fusion.forward=slice", f"model.pretrained={base}",
                 f"lora.base={base}", "lora.ranks={phone-lowend: 2, phone: 4, laptop: 8}",
                 "lora.quantize={phone-lowend: 0, phone: 0, laptop: 0}", "rounds=2", "population.num_clients=4",
                 "selection.clients_per_round=2", "train.local_steps=4", "train.lr=0.01", "data.people=8",
                 "data.general_chars=400", "train.seq_len=64", "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert all({"probe_acc", "answer_loss", "general_loss"} <= set(r) for r in rows)
    assert rows[-1]["answer_loss"] < rows[0]["answer_loss"]
    clients = read_jsonl(out / "clients.jsonl")
    ranks = {"phone-lowend": 2, "phone": 4, "laptop": 8}
    assert len(clients) == 4 and all(c["status"] == "ok" and c["rank"] == ranks[c["device"]] for c in clients)
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_a_users_facts_run_end_to_end_with_generative_distillation(tmp_path):
    """The knowledge recipe on a facts dataset written in the documented format, through Flower's simulation."""
    from fedfusion.data.facts import write_facts

    paths = write_facts(tmp_path / "facts", 4, 24, seed=7)
    out = tmp_path / "knowledge"
    assert main(["run", "knowledge", "rounds=2", f"data.path={paths['train']}", f"data.probes={paths['probes']}",
                 "population.num_clients=4", "selection.clients_per_round=4", "train.local_steps=2",
                 "generative.server_steps=2", "generative.top_k=4", "engine.cpus_per_client=1.0", "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["probe_acc"] <= 1 and r["answer_loss"] > 0 for r in rows)
    assert all(r["clients_ok"] == 4 and r["server_flops"] > 0 and r["bytes_up"] > 0 for r in rows[1:])
    # generative.device_state=node (the recipe's default): each node keeps its model after its first round, and
    # every reply is its samples only (as many each round)
    clients = {(c["round"], c["partition"]): c for c in read_jsonl(out / "clients.jsonl")}
    assert all(clients[1, p]["bytes_down"] > 0 and clients[2, p]["bytes_down"] == 0 for p in range(4))
    assert all(clients[1, p]["bytes_up"] == clients[2, p]["bytes_up"] for p in range(4))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["facts"]["clients"] == 4 and summary["facts"]["probes"] == 24 * 6
    assert (out / "report.md").read_text().startswith("# Run report") and "The target recalls" in (out / "report.md").read_text()
    assert AutoTokenizer.from_pretrained(out / "model").get_vocab()["<bos>"] == 2


def test_generative_grown_from_the_small_model_runs_on_flower(tmp_path):
    """fusion.grow_round with generative distillation: round 1 trains the smallest slice on every node (the
    submodel role), round 2 sends each node its slice of the grown target as its own model and folds samples."""
    from fedfusion.data.facts import write_facts

    paths = write_facts(tmp_path / "facts", 4, 24, seed=7)
    out = tmp_path / "knowledge"
    assert main(["run", "knowledge", "rounds=2", "fusion.grow_round=1", f"data.path={paths['train']}",
                 f"data.probes={paths['probes']}", "population.num_clients=4", "selection.clients_per_round=4",
                 "train.local_steps=2", "generative.server_steps=2", "engine.cpus_per_client=1.0",
                 "--out", str(out)]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["clients_ok"] == 4 for r in rows[1:])
    assert rows[1]["server_flops"] == 0 and rows[2]["server_flops"] > 0  # the server trains after growth
    clients = {(c["round"], c["partition"]): c for c in read_jsonl(out / "clients.jsonl")}
    assert all(clients[1, p]["forward"] == "slice" and clients[2, p]["bytes_down"] > 0 for p in range(4))
    assert all(clients[2, p]["bytes_up"] < clients[1, p]["bytes_up"] for p in range(4))  # samples, not the slice


def test_a_mixed_federation_runs_on_flower_with_a_method_per_tier(tmp_path):
    """Phones distil a tiny family, laptops and desktops train slices: one run, one target, a method on every row."""
    out = tmp_path / "mixed"
    assert main(["run", "mixed", *TINY, "population.num_clients=6", "selection.clients_per_round=6",
                 "distill.server_steps=2", "distill.back_steps=1", "distill.transfer.max_chars=5000",
                 "--out", str(out)]) == 0
    clients = read_jsonl(out / "clients.jsonl")
    assert {c["device"]: c["method"] for c in clients} == {"phone": "distill", "laptop": "submodel",
                                                           "desktop": "submodel"}
    assert all(c["status"] == "ok" for c in clients) and len(clients) == 2 * 6
    rows = read_jsonl(out / "metrics.jsonl")
    assert all(r["clients_ok"] == 6 and r["server_flops"] > 0 and "family_tiny_loss" in r for r in rows[1:])
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def test_a_simulation_engine_that_cannot_start_fails_the_run_at_once(tmp_path, monkeypatch, capsys):
    """Flower's engine dies before any client runs (here: client resources its Ray backend refuses). Flower then
    waits for the ServerApp thread, which used to wait for replies round after round (10 minutes each); the run
    must end within seconds, recorded as failed with Flower's reason."""
    import fedfusion.cli as cli

    monkeypatch.setattr(cli, "backend_config", lambda recipe: {"client_resources": {"num_cpus": "one"}})
    out = tmp_path / "run"
    started = time.monotonic()
    assert main(["run", "rolling", *TINY, "rounds=3", "--out", str(out)]) == 1
    assert time.monotonic() - started < 120
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "simulation engine failed" in summary["error"] and "client resources" in summary["error"]
    assert "run failed" in capsys.readouterr().out
    import ray

    # the failed engine's Ray instance is reaped: this process must not stay connected to it (the next run in the
    # same process would reuse the dead instance, and Ray's driver exits the process when its GCS is gone)
    assert not ray.is_initialized()


@pytest.mark.parametrize("recipe, extra", [
    ("rolling", ["fusion.forward=full", "fusion.frozen_dtype=int8", "fusion.window_rank=0"]),
    ("rolling", ["fusion.forward=full", "fusion.frozen_dtype=int8", "fusion.window_rank=2", "train.checkpoint=true"]),
    ("quickstart", []),  # as it ships: every axis sliced, the core and the shared tensors in every window
])
def test_grow_then_full_forward_windows_run_on_flower(tmp_path, recipe, extra):
    """fusion.grow_round: round 1 trains the smallest slice of a silenced target (the target is that small model);
    round 2 sends every client the whole target frozen in int8 plus its window (role window): the window's exact
    values back, or with fusion.window_rank the factors of a low-rank update of every matrix (that run with
    activation checkpointing, train.checkpoint, on the clients); the quickstart's own core windows too."""
    out = tmp_path / "grow"
    assert main(["run", recipe, *TINY, "fusion.grow_round=1", *extra, "--out", str(out)]) == 0
    clients = read_jsonl(out / "clients.jsonl")
    assert all(c["status"] == "ok" for c in clients) and len(clients) == 2 * 3
    grow = [c for c in clients if c["round"] == 1]
    full = [c for c in clients if c["round"] == 2]
    assert all(c["width"] == 0.125 and c["forward"] == "slice" for c in grow)  # every tier at the smallest width
    assert all(c["forward"] == "full" and c["bytes_down"] > c["bytes_up"] for c in full)  # the frozen target went down
    assert all(0 < c["trained_params"] < c["params"] for c in full)  # priced: the frozen target's work too
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[2]["eval_loss"] < rows[0]["eval_loss"]
