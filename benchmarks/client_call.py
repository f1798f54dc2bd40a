"""What one client message of the quickstart costs the submodel role outside its own training, model cache off and on.

Builds the quickstart's round-1 messages with the real strategy (no Flower runtime, no Ray), then runs the role's
``train`` on each in this process, first with ``FEDFUSION_CLIENT_CACHE=0`` (every message builds its model), then
twice with the cache on (the second pass: every model shape already built). Per message: the seconds outside
``train_s`` (decoding the arrays, the client's windows, building or reloading the model, the optimizer, the reply).

    python benchmarks/client_call.py [LOCAL_STEPS] [--recipe NAME]

``--recipe`` (default ``quickstart``, whose round 1 trains the small model every device holds): ``rolling`` builds
each tier's own slice in round 1.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from fedfusion.clients import submodel
from fedfusion.clients.cache import ENV, MODELS
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedfusion.config.recipe import load_recipe
from fedfusion.run.federation import build_strategy
from fedfusion.run.targets import lm_target
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import Caps


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("local_steps", nargs="?", type=int, default=5, help="each client's local steps (default 5)")
    parser.add_argument("--recipe", default="quickstart", help="the recipe whose round-1 messages are built")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # messages outside a Flower runtime
    recipe = load_recipe(args.recipe)
    recipe.train.local_steps = args.local_steps
    target = lm_target(recipe)
    strategy = build_strategy(recipe, target)
    tiers = ["phone"] * 16 + ["laptop"] * 10 + ["desktop"] * 6

    class Grid:
        def get_node_ids(self) -> list[int]:
            return list(range(100, 100 + len(tiers)))

        def send_and_receive(self, msgs, timeout=None):
            return [Message(RecordDict({"caps": ConfigRecord(Caps(tiers[m.metadata.dst_node_id - 100],
                                                                  m.metadata.dst_node_id - 100, 100).to_config())}),
                            reply_to=m) for m in msgs]

    msgs = list(strategy.configure_train(1, ArrayRecord(target.initial()), ConfigRecord({}), Grid()))
    torch.set_num_threads(1)
    for cache in ("0", "1", "1"):
        os.environ[ENV] = cache
        outside, trained = [], []
        for m in msgs:
            start = time.perf_counter()
            state = decode(m.content["arrays"].to_torch_state_dict())
            _, metrics = submodel.train(state, m.content["config"], strategy.partition_of(m.metadata.dst_node_id))
            outside.append(time.perf_counter() - start - float(metrics["train_s"]))
            trained.append(float(metrics["train_s"]))
        print(f"cache {'on' if cache == '1' else 'off'} (hits so far {MODELS.hits}): outside training "
              f"{1000 * sum(outside) / len(outside):.1f} ms a message (min {1000 * min(outside):.1f}, max "
              f"{1000 * max(outside):.1f}); training {sum(trained) / len(trained):.3f} s; load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
