"""Launching across machines: the deepspeed command, hostfiles, Slurm, Kubernetes, doctor, the shared-storage check."""
