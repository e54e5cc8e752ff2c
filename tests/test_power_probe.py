"""The power probe's arithmetic (glm5lab.bench.power_probe) on made-up reads, and its refusal without a GPU."""
from __future__ import annotations

import pytest
import torch

from glm5lab.bench import power_probe


def _read(clock, power, reasons, energy_mj):
    return {"clock": clock, "power": power, "reasons": reasons, "energy_mj": energy_mj}


def test_block_stats_takes_medians_the_cap_share_energy_per_call_and_busy_share():
    reads = [_read(1980, 500, 0, 1100.0), _read(1800, 650, 0x4, 1300.0), _read(1700, 690, 0x4 | 0x1, 1600.0)]
    got = power_probe.block_stats(800.0, 2000, 1.0, reads, _read(1980, 100, 0, 1000.0), _read(1700, 690, 0x4, 1700.0))
    assert got["time_us"] == pytest.approx(400.0) and got["sm_clock_mhz"] == 1800 and got["power_w"] == 650
    assert got["power_capped"] == pytest.approx(2 / 3)                 # (the sampler's reads, not the ends)
    assert got["energy_uj_per_call"] == pytest.approx(700.0 * 1e3 / 2000)     # 700 mJ over 2000 calls
    assert got["busy"] == pytest.approx(0.8)
    short = power_probe.block_stats(1.0, 10, 1.0, [], _read(1980, 100, 0, 0.0), _read(1900, 300, 0, 1.0))
    assert short["sm_clock_mhz"] == 1940 and short["power_w"] == 200   # (no read in between: the two ends)


def test_rows_of_gives_one_long_format_row_a_form_and_metric():
    blocks = [{"time_us": t, "sm_clock_mhz": 1900.0 - t, "power_w": 600.0, "power_capped": 0.5,
               "energy_uj_per_call": 2 * t, "busy": 0.99} for t in (10.0, 20.0, 30.0, 40.0, 50.0)]
    rows = power_probe.rows_of({"a": blocks, "b": blocks[:1]}, "H128_T512_K2048")
    assert len(rows) == 2 * 6
    t = next(r for r in rows if r["implementation"] == "a" and r["metric"] == "time_us")
    assert (t["p50"], t["value"], t["unit"]) == (30.0, 30.0, "us") and t["p20"] < 30.0 < t["p80"]
    one = next(r for r in rows if r["implementation"] == "b" and r["metric"] == "energy_uj_per_call")
    assert one["p20"] == one["p50"] == one["p80"] == 20.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_power_probe_refuses_without_a_gpu(tmp_path, capsys):
    assert power_probe.main(["--out", str(tmp_path / "p.csv")]) == 1
    assert "needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()


def test_power_probe_names_an_unknown_form_before_anything_else(tmp_path, capsys):
    assert power_probe.main(["--out", str(tmp_path / "p.csv"), "--forms", "flashmla", "ws64cps16x"]) == 1
    err = capsys.readouterr().err
    assert "unknown form(s) ['ws64cps16x']" in err and "flashmla" in err
    assert not (tmp_path / "p.csv").exists()


def test_sustained_samples_alternate_the_forms_and_rotate_their_order(monkeypatch):
    """Every form gets one block a round, in an order rotated by one place a round (no form always first), each block
    of the form's own graph with the calls a replay holds."""
    order = []

    def block(graph, calls, seconds, nvml):
        order.append(graph)
        return {"graph": graph, "calls": calls, "seconds": seconds}

    monkeypatch.setattr(power_probe, "sustained_block", block)
    samples = power_probe.sustained_samples({"a": "ga", "b": "gb", "c": "gc"}, 4, 3, 0.5, nvml=None)
    assert order == ["ga", "gb", "gc", "gb", "gc", "ga", "gc", "ga", "gb"]
    assert {f: [b["graph"] for b in s] for f, s in samples.items()} == {"a": ["ga"] * 3, "b": ["gb"] * 3,
                                                                      "c": ["gc"] * 3}
    assert all(b["calls"] == 4 and b["seconds"] == 0.5 for s in samples.values() for b in s)
