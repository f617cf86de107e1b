"""Keras integration: distribution-aware variables, optimizers, metrics and fit."""
