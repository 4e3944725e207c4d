"""The one-live-run lock, under its first name: it lives in sdzero.config.output_lock (see there why)."""

from sdzero.config.output_lock import LOCK_NAME, claim_output_dir, release_output_dir

__all__ = ["LOCK_NAME", "claim_output_dir", "release_output_dir"]
