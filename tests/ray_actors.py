"""How many Ray actors a simulation test's clients run on (``engine.cpus_per_client``; Flower starts as many actors
as the machine's CPUs hold).

Starting an actor costs ~5 CPU-seconds (Python, torch, Flower, the app), the largest part of a tiny run's first round
on a loaded 2-core machine. A run whose roles keep nothing on their nodes (submodel, window, smallmodel, lora:
:class:`fedfusion.clients.node.Stateless`) checks nothing a second actor adds, so it asks for one (measured alone on
the loaded 2-core host: 5 s less a run). A run whose node state must outlive a change of actor (generative's and the
units mode's ``Node``, secure aggregation's secrets in ``context.state``) keeps two or more."""

from __future__ import annotations

import os

# a 2-core machine's 2 CPUs for each client: one actor; never more CPUs than the machine has, or Ray places none
ONE_ACTOR_CPUS = min(2, os.cpu_count() or 1)
ONE_ACTOR = f"engine.cpus_per_client={float(ONE_ACTOR_CPUS)}"
TWO_ACTORS = "engine.cpus_per_client=1.0"  # one CPU each: two actors on a 2-core machine
