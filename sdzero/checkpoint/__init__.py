"""Checkpoints: the manifest (a leaf), the checkpointer, run identity, universal (elastic) resume, the output lock, export."""
