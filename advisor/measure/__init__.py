"""Measurement: the trainer's trials and launches over a grid of configs, the collectives benchmark and its
alpha-beta fits, and the corrections of raw measurements (ties between launches, contention)."""
