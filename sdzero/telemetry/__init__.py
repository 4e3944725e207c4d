"""Measurements: phase timers, step statistics, metrics.jsonl, memory meters, monitors, the environment snapshot."""
