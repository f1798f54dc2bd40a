"""Generative distillation: devices' own models write text the target learns from."""
