"""Per-worker resources over time: the sampler's series, the rates drawn from it, the figures."""

from __future__ import annotations

import time

import pytest

from kubejax import monitoring
from tests.helpers import assert_self_contained_report


def test_the_sampler_keeps_a_series_with_the_examples_counted():
    sampler = monitoring.ResourceSampler(interval=0.05).start()
    counted = []  # each count() between two clock readings: the test holds on a loaded machine
    for _ in range(5):
        time.sleep(0.06)
        before = time.monotonic()
        sampler.count(8)
        counted.append((before, time.monotonic()))
    summary = sampler.stop()
    series = summary["series"]
    assert summary["examples"] == 40 and series[-1]["examples"] == 40
    assert [p["t"] for p in series] == sorted(p["t"] for p in series)
    assert all(p["rss_mb"] > 0 for p in series)
    # The first count's examples are left out (its step holds the compile).
    (first_before, first_after), (last_before, last_after) = counted[0], counted[-1]
    assert 32 / (last_after - first_before) <= summary["examples_per_s"]
    assert summary["examples_per_s"] <= 32 / (last_before - first_after)


def test_a_long_series_is_thinned_keeping_the_last_sample():
    samples = [{"t": float(i), "examples": i} for i in range(1000)]
    thin = monitoring._thin(samples, 100)
    assert len(thin) == 100 and thin[0] is samples[0] and thin[-1] is samples[-1]
    assert monitoring._thin(samples[:50], 100) == samples[:50]


def test_worker_rates_are_examples_per_second_between_samples():
    series = [{"t": 0.0, "examples": 0}, {"t": 2.0, "examples": 20}, {"t": 4.0, "examples": 60}]
    assert monitoring.worker_rates(series) == ([2.0, 4.0], [10.0, 20.0])
    assert monitoring.worker_rates(series[:1]) == ([], [])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_the_training_report_draws_each_worker_over_time(workers):
    series = [
        {"t": t, "examples": 4 * t, "rss_mb": 100.0 + t, "cpu_percent": 90.0} for t in range(5)
    ]
    resources = [
        {"worker": w, "peak_rss_mb": 104.0, "cpu_percent_mean": 90.0, "series": series}
        for w in range(workers)
    ]
    metrics = {"status": "completed", "train": [{"step": 1, "loss": 1.0, "accuracy": 0.5}]}
    html = monitoring.training_report(metrics, resources)
    assert_self_contained_report(html, figures=6)
    assert "Throughput per worker" in html and "resident memory (MiB)" in html
    assert all(f"worker {w}" in html for w in range(workers))
    assert '"t"' not in html and "series" not in html  # the table leaves the raw series out
