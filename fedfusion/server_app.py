"""The Flower ServerApp for ``flwr run .`` (pyproject's ``serverapp`` component): the recipe comes as run config
(``-c "recipe='recipes/quickstart.yaml' overrides='rounds=3' out='runs/x'"``) and the run is
:func:`fedfusion.run.federation.run_federation`, as ``fedfusion run`` runs it.
"""

from __future__ import annotations

import shlex
from logging import INFO
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedfusion.config.recipe import nodes_per_client
from fedfusion.fusion.submodel.plan import fit_widths
from fedfusion.run.check import load_checked
from fedfusion.run.federation import check_federation, run_federation
from fedfusion.run.interrupt import reap_on_flower_exit
from fedfusion.run.run_dir import RunDir, new_run_path

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for ``flwr run .``: recipe, overrides and output directory come from the run config."""
    reap_on_flower_exit()
    cfg = context.run_config
    resume = str(cfg.get("resume", ""))
    if resume:
        run = RunDir.reopen(Path(resume).resolve())
        if run.finished:
            log(INFO, "fedfusion: %s already finished; nothing to resume, nothing changed", run.path)
            return
        recipe = run.recipe
        check_federation(grid, recipe.population.num_clients, nodes_per_client(recipe))
    else:
        recipe = load_checked(str(cfg.get("recipe", "quickstart")), shlex.split(str(cfg.get("overrides", ""))))
        fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
        check_federation(grid, recipe.population.num_clients, nodes_per_client(recipe))
        run = RunDir(new_run_path(recipe, str(cfg.get("out", "")) or None).resolve(), recipe)
    log(INFO, "fedfusion: writing the run to %s", run.path)
    run_federation(grid, recipe, run, resume=bool(resume))
    log(INFO, "fedfusion: run finished; outputs in %s", run.path)
