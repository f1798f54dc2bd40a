"""How many clients Flower's simulation engine runs at once: what a round's training messages are paced onto
(:class:`fedfusion.strategies.paced.PacedGrid`)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

# "0": push every round's messages at once, as Flower's own grids do (what benchmarks/overhead.py compares with). Not
# a recipe key: the order clients start in changes no result, only the round's wall time.
ENV = "FEDFUSION_PACED"


@dataclass
class EngineSlots:
    """The simulation engine's parallel clients, asked when a round is sent: Flower's Ray backend starts Ray
    beside the ServerApp (``fedfusion run``, ``flwr run`` on a simulation federation) while the server already
    runs, and makes ``pool_size_from_resources`` actors, each holding ``cpus_per_client`` (``engine.cpus_per_client``,
    what ``fedfusion run`` gives the backend). 0 where no Ray runs in this process: a deployment, whose every node
    is its own machine, or with ``FEDFUSION_PACED=0``. Counted once, the first time Ray is up."""

    cpus_per_client: float
    count: int = field(default=0, init=False)

    def __call__(self) -> int:
        if os.environ.get(ENV, "1").strip() == "0":
            return 0
        if not self.count:
            ray = sys.modules.get("ray")
            if ray is None or not ray.is_initialized():
                return 0
            from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources

            self.count = pool_size_from_resources({"num_cpus": self.cpus_per_client, "num_gpus": 0.0})
        return self.count
