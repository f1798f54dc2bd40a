"""Local training: the training step and loops, evaluation, distillation losses, the transfer set."""
