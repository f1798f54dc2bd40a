"""Benchmark: what the server allocates to send one round of the ``finetune`` recipe: the fusion strategy's
``configure_train`` for 4 full-forward window clients on a SmolLM2-135M-shaped target, frozen in int8.

Each arm runs in a fresh process, without Flower's runtime: a random-weight Llama of SmolLM2-135M's shape (memory does
not depend on the weights), the recipe's submodel method built by its registry entry, and the real
:class:`~fedfusion.strategies.fusion.FusionStrategy` over a stand-in Grid of 4 nodes (two low-end phones, a phone, a
laptop) that answers the capability query. The target arrives as Flower's own loop hands it over (an ArrayRecord);
after the allocator is trimmed the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``) and
``configure_train`` runs. Peak: the high-water mark above the resident set before it; held: what stays resident while
the messages are alive (Flower holds them until the clients reply); Python peak: tracemalloc's peak of the step (the
Arrays' bytes and numpy buffers; torch's tensors are not traced). The messages' bytes are counted two ways: sent, the
sum over the clients' records (what travels, identical before and after), and held, each distinct bytes object
once.

Arms: ``recipe`` (the recipe's window widths 1/8, 1/4, 1/2) and ``whole`` (every tier's window the whole target, what
``fusion.auto_widths`` fits to a 4 GB phone or a laptop). ``--baseline REV`` also measures the arms on the code of git
revision ``REV`` (its ``fedfusion/``, ``strategies/``, ``clients/`` and ``recipes/`` exported to a temporary folder);
``--baseline-arms`` limits which (the old code's ``whole`` arm needs over 5 GB). Writes
``benchmarks/results/server_memory.{json,md}``.

    python benchmarks/server_memory.py [--arms recipe whole] [--baseline REV --baseline-arms recipe]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fedfusion.devices.hardware import status_kb

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["recipe", "whole"]
NODES = {1: "phone-lowend", 2: "phone-lowend", 3: "phone", 4: "laptop"}  # the recipe's mix, 4 clients a round
MB = 2**20



def trim() -> int:
    """Collect garbage and hand freed heap back to the kernel; the resident set after, in kB."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_kb("VmRSS")


def one_arm(arm: str) -> dict[str, Any]:
    """Measure ``arm`` in this process (called in a fresh one by :func:`main`), on whatever code is importable."""
    import torch
    from cuda_lora import shape_config
    from fedfusion.strategies.fusion import FusionStrategy, RunState, StrategySettings
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedfusion.fusion.submodel.build import build
    from fedfusion.models.families import family_of
    from fedfusion.run.check import load_checked
    from fedfusion.run.federation import build_participation
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.specs import Caps

    class CapsGrid:
        """The 4 nodes of :data:`NODES`, answering the capability query (all ``configure_train`` asks a Grid)."""

        def get_node_ids(self) -> list[int]:
            return list(NODES)

        def send_and_receive(self, messages: list[Message], timeout: float | None = None) -> list[Message]:
            return [Message(RecordDict({"caps": ConfigRecord(Caps(NODES[m.metadata.dst_node_id], m.metadata.dst_node_id,
                                                                  100).to_config())}), reply_to=m) for m in messages]

    torch.set_num_threads(1)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # messages made outside a Flower run
    overrides = [f"fusion.widths.{tier}=1.0" for tier in sorted(set(NODES.values()))] if arm == "whole" else []
    recipe = load_checked("finetune", overrides)
    cfg = shape_config("135m")
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg)
    state = model.state_dict()
    tiers = sorted(recipe.fusion.widths)
    method = build(recipe.fusion, recipe.seed, SimpleNamespace(model=model, initial=state.copy, params=0), tiers)
    settings = StrategySettings(clients_per_round=len(NODES), query_config={"population": "{}"},
                                train_config={"local-steps": 1, "lr": 0.1, "seed": recipe.seed}, wait_nodes_s=1.0)
    strategy = FusionStrategy(settings, RunState.begin(dict.fromkeys(tiers, method), build_participation(recipe),
                                                       settings))
    initial = ArrayRecord(state)  # the target as Flower's loop hands it to configure_train
    target_mb = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values()) / MB
    del model, state
    base = trim()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the resident set now
    tracemalloc.start()
    start = time.perf_counter()
    messages = list(strategy.configure_train(1, initial, ConfigRecord({}), CapsGrid()))
    seconds = time.perf_counter() - start
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak = status_kb("VmHWM") - base
    held = trim() - base
    records = [m.content["arrays"] for m in messages]
    arrays = [(key, array) for record in records for key, array in record.items()]
    distinct = {id(a.data): a for _, a in arrays}
    frozen = [a for k, a in arrays if k.startswith(FROZEN)]
    round_target = strategy.run.round.target  # configure_train's float32 copy of the record, kept for the fold
    return {"arm": arm, "clients": len(messages), "widths": {t: recipe.fusion.widths[t] for t in tiers},
            "target_mb": target_mb, "record_mb": initial.count_bytes() / MB,
            "round_target_mb": sum(t.numel() * t.element_size() for t in round_target.values()) / MB,
            "seconds": seconds, "peak_mb": peak / 1024, "held_mb": held / 1024,
            "python_peak_mb": python_peak / MB,
            "sent_mb": sum(len(a.data) for _, a in arrays) / MB,
            "distinct_mb": sum(len(a.data) for a in distinct.values()) / MB,
            "frozen_sent_mb": sum(len(a.data) for a in frozen) / MB,
            "frozen_distinct_mb": sum(len(a.data) for a in {id(a.data): a for a in frozen}.values()) / MB,
            "per_client_mb": [r.count_bytes() / MB for r in records]}


def export(rev: str, into: Path) -> None:
    """The code of git revision ``rev`` (the package and the folders it maps in) into the folder ``into``."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fedfusion", "strategies", "clients", "recipes"],
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")


def run_arm(arm: str, code: Path) -> dict[str, Any]:
    """:func:`one_arm` in a fresh process importing the code under ``code``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, __file__, "--one", arm], capture_output=True, text=True, env=env, cwd=code)
    if done.returncode:
        raise RuntimeError(f"arm {arm} on {code} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(data: dict[str, Any]) -> str:
    lines = ["# Server memory of one round's configure step: the finetune recipe, 4 window clients, SmolLM2-135M", "",
             f"Machine: {data['machine']}, torch {data['torch']}, load before {data['load_before']}. A random-weight "
             f"Llama of SmolLM2-135M's shape ({data['rows'][0]['target_mb']:.0f} MiB in float32), the recipe's "
             "`fusion.method=submodel forward=full frozen_dtype=int8 policy=rolling`, the real `FusionStrategy."
             "configure_train` for 4 clients (2 low-end phones, a phone, a laptop) over a stand-in Grid, no Flower "
             "runtime; each arm in a fresh process.", "",
             f"Command: `{data['command']}`", "",
             "| code | arm | peak MiB | held MiB | Python peak MiB | sent MiB | held bytes MiB | frozen sent MiB | "
             "frozen held MiB | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['code']} | {r['arm']} | {r['peak_mb']:.0f} | {r['held_mb']:.0f} | {r['python_peak_mb']:.0f} | "
                     f"{r['sent_mb']:.0f} | {r['distinct_mb']:.0f} | {r['frozen_sent_mb']:.0f} | "
                     f"{r['frozen_distinct_mb']:.0f} | {r['seconds']:.1f} |")
    r = data["rows"][0]
    unmeasured = sorted({x["code"] for x in data["rows"]} - {x["code"] for x in data["rows"] if x["arm"] == "whole"})
    lines += ["", f"What the step makes, in order (one row of the table: the first): the target's float32 tensors "
              f"from Flower's record (`to_torch_state_dict`, {r['round_target_mb']:.0f} MiB from a "
              f"{r['record_mb']:.0f} MiB record: the tied head is a tensor of its own in both; kept for the round's "
              "fold); the frozen target quantised to int8 codes, float16 scales and float16 vectors (torch tensors, "
              f"once a round for every client); each window plan's slice extracted (float32 tensors); then each "
              "client's record: every tensor viewed as numpy (no copy) and saved as npy bytes into a Flower Array "
              "(one copy: `Array.from_numpy_ndarray`'s `np.save` into a buffer whose bytes become the Array's data). "
              "Before, every client's record serialised the frozen target and its window again (`ArrayRecord(payload"
              ".arrays)` per client): held bytes = sent bytes. Now a tensor several payloads hold is serialised once "
              "and its bytes shared (`fedfusion.strategies.records.RoundRecords`), clients of one window plan share "
              "its slice, and each tensor is let go as soon as its bytes are made (the payloads keep none)."
              + "".join(f" The `whole` arm of {code} is not measured (over 5 GB, on a shared machine): its records "
                        "would hold the sent column's bytes, one copy per client, besides a window's float32 tensors "
                        "per client." for code in unmeasured),
              "", "Peak: the resident set's high-water mark during `configure_train` above the resident set before it "
              "(the target's ArrayRecord already held); held: resident after it, while its messages are alive; Python "
              "peak: tracemalloc's (bytes and numpy buffers, not torch tensors). Sent: the bytes of every client's "
              "record added up (what travels; the same on both codes); held bytes: each distinct bytes object once "
              "(what the messages hold in memory); frozen: the same for the int8 frozen target's arrays."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--baseline", default=None, help="a git revision whose code is also measured")
    parser.add_argument("--baseline-arms", nargs="+", default=["recipe"], choices=ARMS)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--one", default=None, choices=ARMS, help="internal: measure one arm here, print it as JSON")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if a.one is not None:
        print(json.dumps(one_arm(a.one)))
        return
    from results_files import run_facts, write_pair

    facts = run_facts("benchmarks/server_memory.py", sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        runs = [(ROOT, head, a.arms)]
        if a.baseline:
            export(a.baseline, Path(tmp))
            runs.append((Path(tmp), a.baseline, a.baseline_arms))
        for code, label, arms in runs:
            for arm in arms:
                rows.append({"code": label, **run_arm(arm, code)})
                print(json.dumps(rows[-1]), flush=True)
    write_pair(a.out_dir, "server_memory", {**facts, "rows": rows}, report({**facts, "rows": rows}))


if __name__ == "__main__":
    main()
