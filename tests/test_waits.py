"""Specs for cumulus_p2p.host.waits: a session's waits for the device, last minute."""

from cumulus_p2p.host.waits import WaitWindow


def test_no_turn_taken_gives_no_percentiles():
    assert WaitWindow().percentiles(now=100.0) is None


def test_the_median_and_the_99th_percentile_are_waits_that_happened():
    window = WaitWindow()
    for i in range(100):
        window.add(i / 1000, now=10.0)  # 0 to 99 ms
    got = window.percentiles(now=10.0)
    assert (got.p50_ms, got.p99_ms, got.samples) == (49.0, 98.0, 100)


def test_one_long_wait_among_a_hundred_short_ones_is_the_99th_percentile_only_past_it():
    window = WaitWindow()
    for _ in range(99):
        window.add(0.001, now=1.0)
    window.add(2.0, now=1.0)
    got = window.percentiles(now=1.0)
    assert got.p99_ms == 1.0 and got.p50_ms == 1.0  # 99 of 100 waited 1 ms
    window.add(2.0, now=1.0)
    assert window.percentiles(now=1.0).p99_ms == 2000.0


def test_waits_older_than_the_window_are_forgotten():
    window = WaitWindow(window_s=60.0)
    window.add(5.0, now=0.0)
    window.add(0.002, now=50.0)
    assert window.percentiles(now=59.0).p99_ms == 5000.0
    assert window.percentiles(now=61.0).p99_ms == 2.0
    assert window.percentiles(now=200.0) is None


def test_only_the_newest_samples_are_kept():
    window = WaitWindow(max_samples=3)
    for waited in (9.0, 0.001, 0.001, 0.001):
        window.add(waited, now=1.0)
    assert window.percentiles(now=1.0).samples == 3
    assert window.percentiles(now=1.0).p99_ms == 1.0
