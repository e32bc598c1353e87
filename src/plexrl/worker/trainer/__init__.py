"""Trainers: per-job weights, optimizers, losses and checkpoints."""
