"""The drift correction (advisor.measure.drift): brackets of the reference, their interpolation, the
noise floor, and the timeline fitted to the brackets and every repeat by leave-one-out."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from advisor.measure.drift import (
    SMOOTHING_CHOICES,
    Bracket,
    Correction,
    Drift,
    Repeat,
    corrected_interval,
    fit_timeline,
    read_drift,
    write_drift,
)

# --------------------------------------------------------------------------------------------------
# Drift between brackets


def brackets(*points: tuple[float, float], width: float = 0.0) -> Drift:
    return Drift("ref", "setup", [Bracket(at, s, s * (1 - width), s * (1 + width)) for at, s in points])


def test_a_trial_between_two_brackets_is_corrected_by_the_interpolated_speed():
    drift = brackets((0.0, 1.0), (100.0, 1.2))
    mid = drift.correction_at(50.0)
    assert mid.factor == pytest.approx(1.1) and mid.bracketed and mid.jump == pytest.approx(0.2)
    # half the jump, relative to the speed there: where in the gap the change fell is unknown
    assert mid.uncertainty == pytest.approx(0.1 / 1.1)
    step, lo, hi = corrected_interval(0.55, 0.54, 0.56, mid)
    assert step == pytest.approx(0.5)
    assert lo < 0.5 * (1 - 0.09) and hi > 0.5 * (1 + 0.09)
    assert drift.correction_at(0.0).factor == 1.0  # the first bracket is the base


def test_after_the_last_bracket_its_speed_holds_with_the_typical_jump_as_uncertainty():
    drift = brackets((0.0, 1.0), (60.0, 1.1))
    after = drift.correction_at(150.0)
    assert after.factor == pytest.approx(1.1) and not after.bracketed
    assert after.uncertainty == pytest.approx(0.1, rel=1e-6)
    assert Drift().correction_at(10.0) == Correction(1.0, 0.0, False)  # no reference yet: no correction


def statistics_median(values: list[float]) -> float:
    return float(np.median(np.abs(values)))


def test_a_contended_bracket_is_left_out_of_the_drift():
    drift = brackets((0.0, 1.0), (100.0, 1.0))
    drift.brackets.insert(1, Bracket(50.0, 2.0, 1.9, 2.1, contended=True))
    assert drift.correction_at(50.0).factor == pytest.approx(1.0)
    assert drift.noise_floor() == pytest.approx(0.0)


def test_noise_floor_is_the_references_repeat_spread():
    drift = brackets((0.0, 1.0), (60.0, 1.1), (120.0, 0.9))
    assert drift.noise_floor() == pytest.approx((0 + 0.1 + 0.1) / 3)
    # a machine that slows steadily is all drift: the interpolation leaves nothing of it
    assert brackets((0.0, 1.0), (60.0, 1.1), (120.0, 1.2)).corrected_floor() == pytest.approx(0.0)
    assert brackets((0.0, 1.0)).noise_floor() is None


def test_correcting_a_simulated_drifting_machine_brings_trials_back_to_their_true_speed():
    """Configs of known step times on a machine whose speed wanders by +-25% over minutes (and wobbles by
    3% within seconds, which no bracket can follow), measured one after another with the reference every
    4 trials: the corrected times are far closer to the truth than the raw ones."""
    rng = np.random.default_rng(3)

    def slowness(t: float) -> float:
        return 1.0 + 0.25 * math.sin(t / 120.0) + 0.03 * math.sin(t / 11.0)

    t, points, trials = 0.0, [], []
    for i in range(24):
        t += 18.0
        if i % 5 == 0:
            points.append((t, 0.1 * slowness(t) * math.exp(rng.normal(0, 0.01))))
        else:
            true = 0.1 * (1 + i % 4)
            trials.append((t, true, true * slowness(t) * math.exp(rng.normal(0, 0.01))))
    drift = brackets(*points)
    base = points[0][1] / 0.1  # the first bracket's slowness: what corrected times are relative to
    raw_error = np.mean([abs(raw / (true * base) - 1) for _, true, raw in trials])
    fixed_error = np.mean(
        [abs(raw / drift.correction_at(at).factor / (true * base) - 1) for at, true, raw in trials]
    )
    # what is left is the wobble, in the trial and in the brackets around it: within twice its size
    assert fixed_error < raw_error / 2 and fixed_error < 2 * 0.03


def test_contended_trials_get_a_wider_lower_end(tmp_path):
    clean = corrected_interval(1.0, 0.98, 1.02, Correction(1.0, 0.0, True))
    lost = corrected_interval(1.0, 0.98, 1.02, Correction(1.0, 0.0, True), contended_share=0.3)
    assert lost[0] == clean[0] and lost[2] == clean[2] and lost[1] < clean[1] - 0.25


def test_drift_json_holds_the_floor_and_the_series_and_reads_back(tmp_path):
    drift = brackets((1.7e9, 1.0), (1.7e9 + 60, 1.1), width=0.02)
    write_drift(tmp_path / "drift.json", drift, {"reruns": []})
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["noise_floor"] == pytest.approx(drift.noise_floor())
    assert data["reference_step_s"] == [1.0, 1.1] and [p["factor"] for p in data["series"]] == [1.0, 1.1]
    assert read_drift(tmp_path / "drift.json", "setup").brackets == drift.brackets
    assert read_drift(tmp_path / "drift.json", "another setup").brackets == []


# --------------------------------------------------------------------------------------------------
# The drift timeline fitted to every repeat, not to the reference alone


def test_two_brackets_alone_are_the_timeline():
    drift = brackets((0, 1.0), (100, 1.3), width=0.02)
    assert fit_timeline(drift.clean(), []) is None  # nothing inside the span to leave out
    assert [b.step_s for b in drift.timeline()] == [1.0, 1.3]
    # a config measured once is no evidence on the drift
    assert fit_timeline(drift.clean(), [Repeat("a", 50, 0.5), Repeat("b", 70, 0.7)]) is None


def test_a_drift_the_brackets_confirm_is_followed_and_a_lone_jump_is_not():
    steady_climb = brackets((0, 1.0), (100, 1.1), (200, 1.2), (300, 1.3), width=0.02)
    fitted = fit_timeline(steady_climb.clean(), [])
    assert fitted.smoothing == min(SMOOTHING_CHOICES)
    assert fitted.factors == pytest.approx([1.0, 1.1, 1.2, 1.3], rel=0.01)
    # one bracket 30% off between steady ones: the neighbours predict it no better with the jump kept
    lone = brackets((0, 1.0), (100, 1.0), (200, 1.3), (300, 1.0), (400, 1.0), width=0.02)
    fitted = fit_timeline(lone.clean(), [])
    assert fitted.smoothing > 1 and max(fitted.factors) < 1.1
    assert lone.correction_at(200).factor < 1.1


def test_repeats_that_agree_with_the_reference_leave_its_drift_as_it_was():
    drift = brackets((0, 1.0), (100, 1.2), (200, 1.2), width=0.02)
    drift.repeats = [
        Repeat("a", 0, 0.5),
        Repeat("a", 200, 0.6),
        Repeat("b", 100, 0.24),
        Repeat("b", 250, 0.24),
    ]
    fitted = fit_timeline(drift.clean(), drift.repeats)
    assert fitted.factors == pytest.approx([1.0, 1.2, 1.2], rel=0.01)
    assert fitted.spreads == pytest.approx([0.0, 0.0, 0.0], abs=0.01)  # next to no residual: little doubt
    assert drift.correction_at(150).factor == pytest.approx(1.2, rel=0.01)


def test_a_bracket_that_the_repeats_contradict_moves_the_timeline_less():
    # The reference's middle bracket is 40% slow, and two configs measured before and after it on each
    # side say the machine did not move: the fitted slowness there lies between, with a doubt it states.
    drift = brackets((0, 1.0), (100, 1.4), (200, 1.0), width=0.02)
    drift.repeats = [Repeat("a", 40, 0.5), Repeat("a", 140, 0.5), Repeat("b", 60, 0.3), Repeat("b", 160, 0.3)]
    fitted = fit_timeline(drift.clean(), drift.repeats)
    assert fitted.factors[0] == 1.0 and 1.0 <= fitted.factors[1] < 1.25 and fitted.spreads[1] > 0.01
    assert abs(drift.correction_at(140).factor - 1) < abs(1.4 * 0.6 + 1.0 * 0.4 - 1) / 2
    assert "2 other config(s) measured more than once" in drift.summary_line()
    assert "chosen by leave-one-out" in drift.summary_line()


def test_drift_json_keeps_the_repeats_and_the_fitted_factors(tmp_path):
    drift = brackets((0, 1.0), (100, 1.4), (200, 1.0), width=0.02)
    drift.repeats = [Repeat("a", 40, 0.5), Repeat("a", 140, 0.5)]
    write_drift(tmp_path / "drift.json", drift)
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["series"][1]["factor"] == pytest.approx(1.4) and data["series"][1]["fitted_factor"] < 1.4
    back = read_drift(tmp_path / "drift.json", drift.setup)
    assert back.repeats == drift.repeats
    assert back.correction_at(140).factor == pytest.approx(drift.correction_at(140).factor)
