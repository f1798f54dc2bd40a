"""A run: building it from a recipe, its lifecycle and recorder, the run directory, checkpoints, interrupts,
``fedfusion compare``'s runs (what executes a run; the plan and the report are ``fedfusion.analysis``'s)."""
