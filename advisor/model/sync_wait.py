"""The wait for the slowest rank: time a rank spends inside a collective that its link does not explain.

A blocking collective ends for everyone when the last rank has arrived, and DeepSpeed's comms_logger (like
any timer around the call) starts timing when the calling rank arrives: a rank that computed faster than
its slowest peer logs its wait for that peer as communication. On 2 shared CPU cores a 1-host trial of
3 ranks logged 39 ms a step for one 2 MB all-reduce that its own link probe costs at a few ms; the rest
was waiting.

That wait does not depend on the link, so it must not be scaled with it: the transport ratio of the
1-node trials (measured / costed communication, `TimeModel.comm_factor`) multiplies the within-node part
only, which is zero at one rank per node, and a wait folded into it would vanish from every hosts x 1
prediction (docs/calibration/scaleout-rounds.md). It is instead split off here and carried as its own
term:

- **What a trial shows.** Where every rank recorded its time in collectives (per step), rank 0's time
  less the least any rank spent: the rank that spent least waited least, so its time is the transport
  (advisor.model.step_time._transport_and_wait). Without those figures, the logged communication less what
  its ops cost on the measured link, where positive: the wait, plus any transport slower than the probe's
  (so it reads more wait than the ranks' spread shows). Where the logged time is below the cost (a faster transport than the probe's), there is no
  wait to tell, and the ratio stays a transport ratio.
- **How it grows with ranks.** If each rank's compute between two synchronising collectives varies
  independently by sigma, a synchronisation ends with the slowest of W ranks and a typical rank waits
  E[max of W] - E[one] = sigma x e(W), e(W) the expected maximum of W standard normal draws (e(1) = 0,
  e(2) = 0.56, e(4) = 1.03, e(32) = 2.07). A trial at W ranks gives sigma per synchronisation,
  `wait / (syncs x e(W))`, and a prediction at W' ranks waits `sigma x syncs' x e(W')`. At the trial's
  own world size and accumulation that is the trial's wait, whatever the rule.
- **How often.** Once per micro-step where the stage's collectives repeat per micro-step (ZeRO-2's
  reductions, ZeRO-3's gathers), once per step otherwise (ZeRO-0/1 reduce at the boundary).
- **What is not modelled.** sigma is kept in seconds, not as a share of compute: from one trial a
  spread that grows with compute cannot be told from a fixed per-call overhead, and both are a few
  percent of the step. The hosts' own extra spread (packet processing charged to whichever rank it
  interrupts) is not in a 1-host trial at all.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

_GRID = np.linspace(-12.0, 12.0, 48_001)
_PDF = np.exp(-0.5 * _GRID**2) / math.sqrt(2 * math.pi)
_CDF = np.array([0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in _GRID])


@lru_cache(maxsize=256)
def expected_max_normal(ranks: int) -> float:
    """E[max of `ranks` independent standard normal draws]: how far the slowest of them lies above a typical
    one, in standard deviations (0 for one rank, 1/sqrt(pi) for two)."""
    if ranks <= 1:
        return 0.0
    density = ranks * _PDF * np.clip(_CDF, 0.0, 1.0) ** (ranks - 1)
    return float(np.trapezoid(_GRID * density, _GRID))


def wait_s(logged_s: float, costed_s: float) -> float:
    """The part of a trial's logged communication that its link does not explain (never negative)."""
    return max(logged_s - costed_s, 0.0)


def sigma_s(wait: float, ranks: int, syncs: int) -> float | None:
    """sigma per synchronisation, seconds, from a trial's wait at `ranks` ranks with `syncs`
    synchronisations a step; None where it says nothing (one rank)."""
    spread = expected_max_normal(ranks)
    if spread <= 0 or syncs <= 0:
        return None
    return wait / (syncs * spread)


def predicted_wait_s(sigma: float, ranks: int, syncs: int) -> float:
    """The wait for the slowest of `ranks` ranks per step, with `syncs` synchronisations a step."""
    return sigma * syncs * expected_max_normal(ranks)
