"""A run: building it from a recipe, the recorder, run directory, checkpoints, report, planner."""
