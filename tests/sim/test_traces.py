"""Trace import (Azure LLM inference format) and the synthetic trace."""

import numpy as np
import pytest

from rose.sim.traces import SAMPLE_CSV, DiurnalBursty, TraceError, diurnal_bursty, load_azure_csv, requests_to_trace, write_sample_csv


def test_good_file(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:46.9000000,396,109\n"
        "\n"
        "2023-11-16 18:15:48.1000000,879,28\n"
    )
    req = load_azure_csv(path)
    assert len(req.times_s) == 3 and req.times_s[0] == 0.0
    assert req.times_s[-1] == pytest.approx(1.4194, abs=1e-3)
    assert req.start_s == pytest.approx(18 * 3600 + 15 * 60 + 46.68059, abs=1e-3)
    trace = requests_to_trace(req)
    assert trace.rate.sum() == 3 and trace.prompt_mean[0] == pytest.approx((374 + 396) / 2)


def test_seconds_timestamps_and_extra_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("ContextTokens,TIMESTAMP,GeneratedTokens,Other\n10,0.5,3,x\n20,2.5,4,y\n")
    req = load_azure_csv(path)
    assert list(req.context) == [10, 20] and req.times_s[-1] == 2.0


@pytest.mark.parametrize(
    "body, line, words",
    [
        ("time,ctx,gen\n1,2,3\n", 1, "lacks TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,3,4\nyesterday,5,6\n", 4, "TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,many,4\n", 3, "must be integers"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,2,3\n2,3,4\n", 3, "back in time"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\n", 2, "fields"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,-2,3\n", 2, "negative"),
    ],
)
def test_bad_file_names_the_line(tmp_path, body, line, words):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(TraceError) as err:
        load_azure_csv(path)
    assert f"line {line}" in str(err.value) and words in str(err.value) and "bad.csv" in str(err.value)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TraceError, match="empty file"):
        load_azure_csv(tmp_path / "empty.csv")
    (tmp_path / "header.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match="no requests"):
        load_azure_csv(tmp_path / "header.csv")
    with pytest.raises(TraceError, match="cannot open"):
        load_azure_csv(tmp_path / "nope.csv")


def test_shipped_sample_is_a_day_in_the_azure_format(tmp_path):
    req = load_azure_csv(SAMPLE_CSV)
    trace = requests_to_trace(req)
    assert 20 * 3600 < trace.duration_s <= 24 * 3600 and len(trace.hours()) == 24
    # the generator writes a file the reader takes back, as many rows as it says
    again = tmp_path / "again.csv"
    rows = write_sample_csv(again, hours=2, mean_rps=0.5, seed=3)
    assert len(load_azure_csv(again).times_s) == rows > 2000


def test_synthetic_shape_has_a_daily_cycle_and_bursts():
    t = diurnal_bursty(24 * 3600, 0.0, DiurnalBursty(amplitude=0.3, peak_hour=14.0, burst_every_s=600, burst_factor=2.0), seed=1)
    hourly = t.rate.reshape(24, 3600).mean(axis=1)
    assert int(np.argmax(hourly)) in range(11, 18) and int(np.argmin(hourly)) in (0, 1, 2, 3, 4, 23)
    assert t.rate.max() > 1.9 * np.median(t.rate)
    assert np.array_equal(
        t.rate, diurnal_bursty(24 * 3600, 0.0, DiurnalBursty(amplitude=0.3, peak_hour=14.0, burst_every_s=600, burst_factor=2.0), seed=1).rate
    )
