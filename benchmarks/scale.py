"""Server memory and per-round time of one federation as its population grows.

One `fedfusion run RECIPE` per population size (default 100, 1,000 and 10,000 virtual clients), each through Flower's
simulation engine exactly as a user runs it, with 50 clients sampled per round from a pool of 200
(``selection.pool``: a population of at most 200 is queried whole in round 1; a larger one is drawn from a random
200 of its nodes each round, the new ones queried for their capabilities) and a small target (a one-layer Llama,
hidden 64) trained one local step, so that what grows with the population is the federation's own cost, not
training. The data is a text file cut into one equal shard per client (``data.source: text``), built from
the Shakespeare plays repeated to 1,500 characters per client.

Measured, per size: the resident memory (RSS) of the `fedfusion run` process, which holds the server (strategy,
central evaluation, ledgers) and Flower's simulation engine (its node registry and message store), sampled every
0.2 s: its peak, and its value as each round's metrics row lands; the Ray client actors' RSS (separate
processes); and from metrics.jsonl each round's host seconds (each includes the capability QUERY of its pool's
new nodes) next to the seconds its clients trained (``train_s`` summed, over the 2 cores they were given).

    python benchmarks/scale.py                      # 100, 1,000 and 10,000 clients
    python benchmarks/scale.py --sizes 100 1000     # some sizes only (the results file keeps the others)

Writes benchmarks/results/scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from fedfusion.strategies.sweep import ENV as SWEEP_ENV

from fedfusion.run.slots import ENV as PACED_ENV

# results measured on the rolling slices (the quickstart's recipe until it switched to growth)
RECIPE = "rolling"
OUT = Path(__file__).parent / "results"
PER_ROUND, POOL, ROUNDS, CHARS_PER_CLIENT = 50, 200, 4, 1500
FLOWER_SWEEP_CHECKS = 2_000_000  # the probe times Flower's sweep up to nodes x pending this many (~35 s a sweep)
SETTINGS = [
    f"rounds={ROUNDS}", f"selection.clients_per_round={PER_ROUND}", f"selection.pool={POOL}", "data.source=text", "data.eval_chars=4000",
    "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=8", "model.intermediate_size=128",
    "model.num_layers=1", "train.local_steps=1", "train.batch_size=4", "train.seq_len=32",
    "engine.cpus_per_client=1", "output.save_model=false", "output.checkpoint_every=0",
]
MB = 2**20
NOTES = [
    "## What grows with the population, and why",
    "",
    "- **Memory.** Per client the server keeps Flower's node registry (every SuperNode of the simulation: its "
    "LinkState entry and a Context). The simulation's text is read a client's shard at a time from the file "
    "(`fedfusion/data/shards.py`; runs before it held the whole text and its shards: 330 MB at 100,000 clients). "
    "fedfusion's strategy keeps the capability "
    "answers (device tier, partition, examples, host facts) of the nodes its candidate pools held: all of a "
    "population within `selection.pool`, else at most `pool` new nodes a round, whatever the population. No "
    "per-client model, optimizer or ledger state is kept: the ledgers go to disk each round. The probe's bytes "
    "are that growth, by owner.",
    "- **Time.** Flower's simulation engine sweeps the nodes every 0.1 s, asking the in-memory LinkState for each "
    "node's next message (`vce_api.add_messages_to_queue`), and `InMemoryLinkState.get_message_ins` looks through "
    "every stored message, checking each: Flower's sweep costs nodes x pending messages, in the server's process. "
    "`fedfusion run` sweeps only the nodes with a message waiting (`strategies/sweep.py`: the same asks of those "
    "nodes, none of the others), so a sweep costs waiting nodes x pending messages whatever the population; the "
    "probe times both. fedfusion's own per-round work over the population (the pool and the draw) is the probe's "
    "sampling time.",
    "- **Why a pool and not a QUERY of everyone in batches.** Until `selection.pool`, round 1 sent the QUERY to "
    "every node at once; at 10,000 nodes it outlasted the 600 s round deadline on this machine and the run was "
    "stopped after 31 minutes with no client trained (this file at commit a233ac9). Batches would not have "
    "helped: the same nodes x messages checks spread over more sweeps, and still every node asked. The server "
    "cannot skip the QUERY either: it learns which partition (and, deployed, which device tier) a node is only "
    "from its answer, since Flower gives a server no view of a node's config and node ids are random per run.",
]


def corpus(path: Path, clients: int) -> Path:
    """A text file of ``clients`` x CHARS_PER_CLIENT characters: the Shakespeare roles' text, repeated."""
    from fedfusion.data.text import load_shakespeare_roles

    text = "\n".join(role.text for role in load_shakespeare_roles(min_chars=0))
    need = clients * CHARS_PER_CLIENT
    path.write_text((text * (need // len(text) + 1))[:need], encoding="utf-8")
    return path


class Sampler(threading.Thread):
    """RSS of a process (and separately of its Ray actors) every ``period_s``, and at each new metrics row."""

    def __init__(self, pid: int, metrics: Path, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.proc, self.metrics, self.period_s = psutil.Process(pid), metrics, period_s
        self.peak = self.actors_peak = self.last = 0
        self.at_round: dict[int, int] = {}
        self.done = threading.Event()

    def _actors(self) -> int:
        total = 0
        for child in self.proc.children(recursive=True):
            try:
                if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::ClientAppActor"):
                    total += child.memory_info().rss
            except psutil.Error:
                continue
        return total

    def run(self) -> None:
        while not self.done.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            if not rss:  # an exited process not yet reaped reads 0
                return
            self.peak, self.last = max(self.peak, rss), rss
            self.actors_peak = max(self.actors_peak, self._actors())
            if self.metrics.exists():
                rows = self.metrics.read_text().count("\n")
                if rows and rows - 1 not in self.at_round:
                    self.at_round[rows - 1] = rss
            time.sleep(self.period_s)


def stop(proc: subprocess.Popen) -> None:
    """Stop a `fedfusion run` the way a user does: Ctrl-C (it stops at the next round boundary), Ctrl-C again
    (forced), then SIGKILL to it and every process it started (its private Ray instance) if still alive."""
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for _ in range(2):
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in family:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            continue


def run_size(clients: int, work: Path, limit_s: float) -> dict[str, Any]:
    """One federation of ``clients`` virtual clients; its memory and per-round timings. A run still going after
    ``limit_s`` is stopped and reported as far as it got (``finished: false``)."""
    data = corpus(work / f"text-{clients}.txt", clients)
    out = work / f"run-{clients}"
    cmd = [sys.executable, "-m", "fedfusion", "run", RECIPE, *SETTINGS, f"data.path={data}",
           f"population.num_clients={clients}", "--out", str(out)]
    env = {**os.environ, "FEDFUSION_CACHE": str(work / "cache")}
    start = time.perf_counter()
    log_path = work / f"run-{clients}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(proc.pid, out / "metrics.jsonl")
        sampler.start()
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop(proc)
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - start
    finished = proc.returncode == 0 and (out / "summary.json").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if out.exists() else []
    if not finished and not rows:
        raise RuntimeError(f"{clients} clients: fedfusion run exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    ledger = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
    answered = len((out / "nodes.jsonl").read_text().splitlines())  # nodes whose capability answer arrived
    rounds = []
    for row in rows[1:]:
        trained = [c["train_s"] for c in ledger if c["round"] == row["round"] and c["status"] == "ok"]
        rounds.append({"round": row["round"], "wall_s": row["wall_s"], "clients_ok": row["clients_ok"],
                       "train_s_sum": sum(trained), "rss_mb": sampler.at_round.get(row["round"], 0) / MB})
    steady = rounds[1:]
    return {
        # WORK: the benchmark's temporary folder (no machine path in the results)
        "clients": clients, "command": " ".join(cmd[1:]).replace(str(work), "WORK"), "finished": finished, "run_wall_s": wall,
        "nodes_answered_query": answered,
        "limit_s": limit_s, "server_rss_peak_mb": sampler.peak / MB, "actors_rss_peak_mb": sampler.actors_peak / MB,
        "server_rss_round0_mb": sampler.at_round.get(0, 0) / MB, "server_rss_last_mb": sampler.last / MB,
        "round1_wall_s": rounds[0]["wall_s"] if rounds else None,
        "steady_round_wall_s": statistics.median(r["wall_s"] for r in steady) if steady else None,
        "steady_train_s_per_core": statistics.median(r["train_s_sum"] for r in steady) / 2 if steady else None,
        "rounds": rounds,
    }


def registry_probe(nodes: int) -> dict[str, float]:
    """What a population of ``nodes`` costs the server process by itself, without running clients. Bytes held for
    the whole run, by owner, traced in this process (tracemalloc):

    - ``flower_registry``: Flower's simulation engine registering ``nodes`` SuperNodes, as ``run_simulation``
      does (its in-memory LinkState, and a node-info store with a Context per node), per node;
    - ``fedfusion_state``: what the strategy holds after ROUNDS participation draws with ``selection.pool`` POOL
      (a real :class:`FusionStrategy` over a width-slicing method, every node answering with a real capability reply,
      as :func:`fedfusion.client_app.query` builds it), with the number of nodes its pools queried;

    and seconds per round that grow with the population: the strategy's sampling (wait for nodes, the pool, the
    QUERY of its new nodes, the participation draw over it) and one sweep of the simulation engine delivering
    the pending messages (:func:`poll_sweep_s`), none, a round's, a pool's and up to 1,000, by Flower's own sweep
    (where nodes x pending is at most FLOWER_SWEEP_CHECKS) and by fedfusion's (:mod:`fedfusion.strategies.sweep`).
    """
    import tracemalloc

    import torch
    from fedfusion.strategies.fusion import FusionStrategy, RunState, StrategySettings
    from fedfusion.strategies.sweep import FLOWER_SWEEP, sweep
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.server.superlink.fleet.vce.vce_api import _register_node_info_stores, _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation import NoOpFederationManager
    from transformers import LlamaConfig

    from fedfusion.devices.catalog import assign_tiers, load_catalog
    from fedfusion.devices.hardware import capabilities
    from fedfusion.fusion.submodel.method import SubModelMethod
    from fedfusion.selection.participation import Participation
    from fedfusion.selection.selectors import make_selector

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    mapping = _register_nodes(nodes, factory)
    stores = _register_node_info_stores(mapping, Run.create_empty(run_id=1))
    flower = tracemalloc.get_traced_memory()[0] - before

    tiers = assign_tiers({"phone": 0.5, "laptop": 0.3, "desktop": 0.2}, nodes, 0)

    host = capabilities("cpu")  # measured once: the sampling time is the server's, not the fake nodes'

    class Grid:  # every node answers the capability query as the real client does
        def get_node_ids(self) -> list[int]:
            return list(mapping)

        def send_and_receive(self, messages, timeout=None):
            return [Message(RecordDict({"caps": ConfigRecord({
                "device": tiers[mapping[m.metadata.dst_node_id]], "partition": mapping[m.metadata.dst_node_id],
                "examples": 42, **host})}), reply_to=m) for m in messages]

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_hidden_layers=1, intermediate_size=128)
    from transformers import LlamaForCausalLM

    method = SubModelMethod(config, {"phone": 0.125, "laptop": 0.25, "desktop": 0.5},
                            LlamaForCausalLM(config).state_dict(), policy="rolling", stride=0.125, stagger=True)
    settings = StrategySettings(clients_per_round=PER_ROUND, min_clients=1, pool=POOL, query_config={"population": "{}"},
                                train_config={"seed": 0})
    participation = Participation(make_selector("random"), load_catalog())
    strategy = FusionStrategy(settings, RunState.begin(dict.fromkeys(("phone", "laptop", "desktop"), method),
                                                       participation, settings))
    grid = Grid()
    torch.set_num_threads(1)
    before = tracemalloc.get_traced_memory()[0]
    for server_round in range(1, ROUNDS + 1):
        assert len(strategy.sample(grid, server_round)) == PER_ROUND
    ours = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    queried = len(strategy.run.caps)
    pending = sorted({0, PER_ROUND, min(POOL, nodes), min(nodes, 1000)})
    assert len(stores) == nodes and queried <= ROUNDS * POOL
    start = time.perf_counter()
    for server_round in range(ROUNDS + 1, ROUNDS + 6):
        assert len(strategy.sample(grid, server_round)) == PER_ROUND
    sample_s = (time.perf_counter() - start) / 5
    return {"nodes": nodes, "flower_registry_bytes_per_node": flower / nodes, "fedfusion_state_bytes": ours,
            "fedfusion_nodes_queried": queried, "fedfusion_sample_ms": sample_s * 1e3,
            "flower_poll_sweep_ms": {str(p): poll_sweep_s(factory, mapping, p, FLOWER_SWEEP) * 1e3
                                     for p in pending if p * nodes <= FLOWER_SWEEP_CHECKS},
            "fedfusion_poll_sweep_ms": {str(p): poll_sweep_s(factory, mapping, p, sweep) * 1e3 for p in pending}}


def registered_run(factory: Any, run_id: int) -> tuple[Any, Any]:
    """The in-memory LinkState of ``factory`` with the run ``run_id`` registered as ``run_simulation`` registers its
    own, and a Grid pushing for that run (what a ServerApp's messages go through)."""
    from flwr.proto.task_pb2 import Task
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    state = factory.state()
    run = Run.create_empty(run_id=run_id)
    run.primary_task_id, run.federation_id = run_id, NOOP_FEDERATION_ID
    state.run_ids[run_id] = RunRecord(run=run)
    state.task_store[run_id] = Task(task_id=run_id, run_id=run_id)
    grid = InMemoryGrid(factory)
    grid.set_run(run)
    return state, grid


class OneSweep(threading.Event):
    """A stop event that lets the engine's loop make exactly one sweep (its wait after the sweep stops it)."""

    def wait(self, timeout: float | None = None) -> bool:
        self.set()
        return True


def poll_sweep_s(factory: Any, mapping: dict[int, int], pending: int, engine: Any) -> float:
    """Seconds of one sweep of the engine's loop ``engine`` (Flower's ``vce_api.add_messages_to_queue`` or
    fedfusion's :func:`fedfusion.strategies.sweep.sweep`) over every node while ``pending`` messages (to as many
    nodes) await their replies: Flower's asks the LinkState for each node's next message, and the in-memory
    LinkState looks through every stored message, checking each, for each node (``InMemoryLinkState.get_message_ins``);
    fedfusion's asks the nodes with a message undelivered. The sweep that delivers them is timed."""
    from queue import Queue

    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    run_id = len(factory.state().run_ids) + 7  # a fresh run per call
    state, grid = registered_run(factory, run_id)
    TaskIdentity.run_id = run_id  # messages take their run from the task identity
    messages = [Message(RecordDict({"config": ConfigRecord({"k": 1})}), dst_node_id=n, message_type=MessageType.QUERY)
                for n in list(mapping)[:pending]]
    for m in messages:
        m.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, as the Grid's own create_message sets it
    stored = [i for i in grid.push_messages(messages) if i]
    assert len(stored) == pending, f"{len(stored)} of {pending} messages stored"
    queue: Queue[Message] = Queue()
    start = time.perf_counter()
    engine(state, queue, mapping, OneSweep())
    seconds = time.perf_counter() - start
    assert queue.qsize() == pending, f"{queue.qsize()} of {pending} messages delivered"
    state.delete_messages(message_ins_ids=set(stored))
    return seconds


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_at_start": os.getloadavg()[0]}


def findings(report: dict[str, Any]) -> list[str]:
    """What the numbers say, computed from them: memory per client between the run sizes, growth over rounds."""
    runs = sorted((r for r in report["sizes"].values() if r["rounds"]), key=lambda r: r["clients"])
    complete = [r for r in runs if r.get("finished", True)]
    lines = []
    for r in runs:
        rounds = r["rounds"]
        if not r.get("finished", True):
            done = "; ".join(f"round {x['round']}: {x['wall_s']:.0f} s, {x['clients_ok']} of {PER_ROUND} clients ok"
                             for x in rounds)
            lines.append(f"- {r['clients']:,} clients: stopped after {r['run_wall_s'] / 60:.0f} min ({done}); server "
                         f"RSS {r['server_rss_round0_mb']:.0f} MB before round 1, peak {r['server_rss_peak_mb']:.0f} MB.")
            continue
        lines.append(f"- {r['clients']:,} clients: server RSS {rounds[0]['rss_mb']:.0f} MB after round 1, "
                     f"{rounds[-1]['rss_mb']:.0f} MB after round {rounds[-1]['round']}: "
                     f"{rounds[-1]['rss_mb'] - rounds[0]['rss_mb']:+.0f} MB over the rounds that sample "
                     f"{PER_ROUND} of them; {r.get('nodes_answered_query', '?')} nodes queried in all.")
    if len(complete) > 1:
        lo, hi = complete[0], complete[-1]
        per = (hi["rounds"][-1]["rss_mb"] - lo["rounds"][-1]["rss_mb"]) * MB / (hi["clients"] - lo["clients"])
        lines.append(f"- From {lo['clients']:,} to {hi['clients']:,} clients the server's RSS after the last round "
                     f"changes by {per / 1024:.1f} KB per client (RSS also moves with the allocator and the "
                     "machine's load; the probe below traces the bytes).")
        if lo["steady_round_wall_s"] and hi["steady_round_wall_s"]:
            lines.append(f"- {hi['clients']:,} against {lo['clients']:,} clients: server RSS after round 1 "
                         f"{hi['rounds'][0]['rss_mb'] / lo['rounds'][0]['rss_mb']:.2f}x, its peak "
                         f"{hi['server_rss_peak_mb'] / lo['server_rss_peak_mb']:.2f}x; steady round "
                         f"{hi['steady_round_wall_s'] / lo['steady_round_wall_s']:.2f}x.")
    for p in report.get("probe", []):
        sweeps = ", ".join(f"{float(ms) / 1e3:.2f} s with {int(k):,} pending" for k, ms in p["flower_poll_sweep_ms"].items())
        ours = ", ".join(f"{float(ms) / 1e3:.3f} s with {int(k):,}" for k, ms in p.get("fedfusion_poll_sweep_ms", {}).items())
        lines.append(f"- Probe, {p['nodes']:,} nodes: Flower's node registry {p['flower_registry_bytes_per_node']:.0f} "
                     f"B/node; fedfusion's strategy after {ROUNDS} draws {p['fedfusion_state_bytes'] / 1024:.0f} KB "
                     f"({p['fedfusion_nodes_queried']:,} nodes queried, "
                     f"{p['fedfusion_state_bytes'] / p['fedfusion_nodes_queried']:.0f} B each); its sampling "
                     f"{p['fedfusion_sample_ms']:.1f} ms/round; one sweep of Flower's engine over every node (it sweeps "
                     f"again 0.1 s after each): {sweeps or 'not timed (too long)'}"
                     + (f"; fedfusion's sweep over the waiting nodes: {ours}." if ours else "."))
    return lines


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write(report: dict[str, Any], name: str = "scale") -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    lines = [
        "# Scale: server memory and round time as the population grows",
        "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs, {m['memory_gb']} GB; "
        + ("**shared with other jobs while this ran** " if m["load_average_at_start"] > 1.0 else "quiet ")
        + f"(load average {m['load_average_at_start']:.1f} at the start of the last run)"
        + (", so seconds are noisy and memory is not." if m["load_average_at_start"] > 1.0 else "."),
        "",
        f"Command: `{report.get('command', 'python benchmarks/scale.py')}`",
        "",
        f"One `fedfusion run {RECIPE}` per size, settings below.",
        "",
        f"Settings: {PER_ROUND} clients per round, {ROUNDS} rounds, a one-layer Llama target (hidden 64), one local "
        f"step per client, {CHARS_PER_CLIENT} characters of text per client, 2 client actors (1 CPU each), "
        f"`selection.pool={POOL}`. Each round includes the capability QUERY of its pool's new nodes (a population "
        f"within the pool: all of it, in round 1); rounds 2+ are the steady state. A round's training messages "
        + ("pushed paced onto the 2 actors longest first (the default)." if report.get("paced", False) else
           "pushed all at once, as Flower's grids do (`FEDFUSION_PACED=0`, or a run from before pacing).")
        + (" The engine sweeps only the nodes with a message waiting (`strategies/sweep.py`, the default)."
           if report.get("sweep") == "waiting nodes" else
           " The engine sweeps every node, as Flower's own does (`FEDFUSION_SWEEP=flower`, or a run from before "
           "`strategies/sweep.py`)."),
        "",
        "| clients | nodes queried | server RSS before round 1 MB | server RSS peak MB | after round 1 MB | "
        "after last round MB | actors RSS peak MB | round 1 s | steady round s (median) | "
        "clients' train s per core (median) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(report["sizes"].values(), key=lambda r: r["clients"]):
        rounds = r["rounds"]
        queried = f"{r['nodes_answered_query']:,}" if "nodes_answered_query" in r else "-"  # older results lack it
        cells = [f"{r['clients']:,}", queried, f"{r['server_rss_round0_mb']:.0f}", f"{r['server_rss_peak_mb']:.0f}",
                 f"{rounds[0]['rss_mb']:.0f}" if rounds else "-", f"{rounds[-1]['rss_mb']:.0f}" if rounds else "-",
                 f"{r['actors_rss_peak_mb']:.0f}", _num(r["round1_wall_s"], 1), _num(r["steady_round_wall_s"], 1),
                 _num(r["steady_train_s_per_core"], 2)]
        if not r.get("finished", True):
            cells[0] += f" (stopped after {r['run_wall_s'] / 60:.0f} min, {len(rounds)} rounds done)"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Findings (computed from the numbers above)", "", *findings(report), "", *NOTES]
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[100, 1000, 10000], help="populations to run")
    parser.add_argument("--limit-min", type=float, default=60, help="stop a run still going after this many minutes")
    parser.add_argument("--probe", type=int, nargs="*", default=[100, 1000, 10000],
                        help="populations to probe in-process (registry bytes per node, sampling and polling time)")
    parser.add_argument("--name", default="scale", help="writes NAME.json and NAME.md (sizes already there are kept)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    path = OUT / f"{args.name}.json"
    report = json.loads(path.read_text()) if path.exists() else {"sizes": {}}
    if args.probe or args.sizes:
        report["machine"] = machine()
        report["paced"] = os.environ.get(PACED_ENV, "1").strip() != "0"
        report["sweep"] = "flower" if os.environ.get(SWEEP_ENV, "").strip() == "flower" else "waiting nodes"
        report["command"] = ("" if report["paced"] else f"{PACED_ENV}=0 ") + (
            f"{SWEEP_ENV}=flower " if report["sweep"] == "flower" else "") + shlex.join(
            ["python", "benchmarks/scale.py", *sys.argv[1:]])
    if args.probe:
        report.pop("probe", None)  # measured again below
    write(report, args.name)  # with neither: the report rewritten from the results file
    if args.probe:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # one line per pushed message otherwise
        report["probe"] = [registry_probe(n) for n in args.probe]
        print(json.dumps(report["probe"]), flush=True)
        write(report, args.name)
    with tempfile.TemporaryDirectory(prefix="ffscale") as tmp:
        for clients in args.sizes:
            report["machine"] = machine()
            result = run_size(clients, Path(tmp), args.limit_min * 60)
            report["sizes"][str(clients)] = result
            print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "command")}), flush=True)
            write(report, args.name)


if __name__ == "__main__":
    main()
