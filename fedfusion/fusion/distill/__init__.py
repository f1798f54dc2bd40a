"""Distillation of small model families into the target (FedDF, Fed-ET)."""
