"""The throughput model: prior before measurements, Amdahl fit after."""

import math

import pytest

from airflow_elastic_gpu.scheduling.throughput import ThroughputModel


def test_prior_is_near_linear_before_any_sample():
    m = ThroughputModel(prior_alpha=0.0, prior_steps_per_s=2.0)
    assert m.steps_per_s(1) == pytest.approx(2.0)
    assert m.speedup(4) == pytest.approx(4.0)


def test_one_measured_count_sets_the_scale_and_keeps_the_prior_shape():
    m = ThroughputModel(prior_alpha=0.1).with_sample(2, 10.0)
    assert m.steps_per_s(2) == pytest.approx(10.0)
    # t(n) = t1 n / (1 + 0.1 (n-1)); t(2)=10 -> t1 = 5.5
    assert m.steps_per_s(1) == pytest.approx(5.5)
    assert m.steps_per_s(4) == pytest.approx(5.5 * 4 / 1.3)


def test_two_counts_fit_amdahl_exactly():
    t1, alpha = 8.0, 0.25
    true = lambda n: t1 * n / (1 + alpha * (n - 1))
    m = ThroughputModel().with_sample(1, true(1)).with_sample(4, true(4))
    for n in (2, 3, 8):
        assert m.steps_per_s(n) == pytest.approx(true(n), rel=1e-9)


def test_no_gain_from_more_gpus_is_learned_as_flat():
    m = ThroughputModel().with_sample(1, 10.0).with_sample(4, 9.0)
    assert m.steps_per_s(8) <= 10.0 + 1e-9
    assert m.steps_per_s(2) == pytest.approx(m.steps_per_s(3))


def test_samples_at_one_count_are_smoothed():
    m = ThroughputModel().with_sample(2, 10.0).with_sample(2, 20.0)
    assert 10.0 < m.steps_per_s(2) < 20.0


@pytest.mark.parametrize("n,t", [(0, 1.0), (1, 0.0), (2, -1.0)])
def test_bad_samples_are_rejected(n, t):
    with pytest.raises(ValueError, match="bad throughput sample"):
        ThroughputModel().with_sample(n, t)


def test_bad_prior_is_rejected():
    with pytest.raises(ValueError, match="prior_alpha"):
        ThroughputModel(prior_alpha=1.0)
    with pytest.raises(ValueError, match="num_gpus"):
        ThroughputModel().steps_per_s(0)
    assert math.isfinite(ThroughputModel().steps_per_s(1000))
