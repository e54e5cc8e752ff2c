"""The wave stamps (glm5lab.bench.wave_spread; the dual and paired fp8_ds_mla kernels' WAVE_STAMPS): the arithmetic on
made-up programs, the programs' CSV and plot, the refusals; on the GPU, that stamping leaves the results alone and
that the stamps place every program on an SM as the kernels' residency says."""
from __future__ import annotations

import pytest
import torch

from glm5lab.bench import wave_spread
from glm5lab.errors import Glm5labError


def _us(*programs):
    """(sm, start_us, end_us) -> (sm, start_ns, end_ns)."""
    return [(sm, int(a * 1000), int(b * 1000)) for sm, a, b in programs]


def test_spread_parts_reads_ends_tail_occupancy_and_drain():
    """Two slots, three programs: SM 0 busy 0-10 us, SM 1 0-6 then 6-8. Ends 6 / 8 / 10: median 8, tail 2; 18 us of
    program time over 2 slots x 10 us = 0.9. The drain counts from the last start or end at which >= 90% of the
    slots ran programs: at 0 and 6 both run, at 8 one does, so 10 - 6 = 4 us."""
    got = wave_spread.spread_parts(_us((0, 0, 10), (1, 0, 6), (1, 6, 8)), slots=2)
    want = {"programs": 3.0, "sms": 2.0, "last_start_us": 6.0, "end_p10_us": 6.4, "end_p50_us": 8.0,
            "end_p90_us": 9.6, "end_last_us": 10.0, "tail_us": 2.0, "occupancy": 0.9, "drain_us": 4.0}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    # the same programs on a GPU of 4 slots never fill 90% of it: no drain, occupancy halved
    wide = wave_spread.spread_parts(_us((0, 0, 10), (1, 0, 6), (1, 6, 8)), slots=4)
    assert wide["drain_us"] == 0.0 and wide["occupancy"] == pytest.approx(0.45)
    # one program: every quantile is its end, and the call starts at its start (globaltimer is absolute)
    one = wave_spread.spread_parts(_us((5, 100, 103)), slots=1)
    assert (one["end_p10_us"], one["end_p90_us"], one["tail_us"], one["occupancy"]) == (3.0, 3.0, 0.0, 1.0)


def test_programs_of_drops_programs_that_wrote_nothing():
    rows = [[1000, 7] + [-1] * 11 + [3000, -1, -1], [-1] * 16, [1100, 9] + [-1] * 11 + [2500, -1, -1]]
    assert wave_spread.programs_of(rows) == [(7, 1000, 3000), (9, 1100, 2500)]
    with pytest.raises(Glm5labError, match="no program of the call wrote its stamps"):
        wave_spread.spread_parts(wave_spread.programs_of([[-1] * 16]), slots=132)
    with pytest.raises(Glm5labError, match="slots must be >= 1, got 0"):
        wave_spread.spread_parts(_us((0, 0, 1)), slots=0)


def test_program_rows_count_from_the_call_s_first_start():
    rows = wave_spread.program_rows(_us((3, 2, 5), (4, 1, 9)), "glm5lab", "H8_T2_K2048", 264)
    assert [(r["program"], r["sm"], r["start_us"], r["end_us"], r["slots"]) for r in rows] == [
        (0, 3, 1.0, 4.0, 264), (1, 4, 0.0, 8.0, 264)]


def test_summary_rows_take_medians_over_calls():
    calls = [wave_spread.spread_parts(_us((0, 0, e), (1, 0, 5)), slots=2) for e in (6, 8, 10, 12, 14)]
    rows = wave_spread.summary_rows(calls, "H16_T512_K2048", "glm5lab")
    assert len(rows) == len(calls[0])
    last = next(r for r in rows if r["metric"] == "end_last_us")
    assert (last["value"], last["unit"]) == (10.0, "us") and last["p20"] < 10.0 < last["p80"]
    assert next(r for r in rows if r["metric"] == "occupancy")["unit"] == "fraction"
    assert next(r for r in rows if r["metric"] == "programs")["unit"] == "count"


def test_programs_csv_appends_runs_and_plots_the_latest(tmp_path):
    path, png = tmp_path / "programs.csv.gz", tmp_path / "wave.png"
    progs = [{"implementation": f, "shape": "H16_T4_K2048", "slots": 2, "program": i, "sm": i % 2,
              "start_us": 0.1 * i, "end_us": 5.0 + i} for f in ("glm5lab", "pair16sopd3") for i in range(4)]
    wave_spread.write_programs(str(path), progs, "test")
    wave_spread.write_programs(str(path), progs[:4], "test")
    import pandas as pd

    frame = pd.read_csv(path)
    assert len(frame) == 12 and {"gpu", "git_sha", "command"} <= set(frame.columns)
    assert wave_spread.plot(str(path), str(png)) == str(png) and png.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp*"))


def test_resident_pairs_compare_the_second_program_of_each_wave_with_the_first():
    """SM 0 runs 0-10 and 0-12 us (a tie at the start: the lower index is the older), then 10-20 and 12-23; SM 1
    runs 1-9 and 0.5-8.5 (listed second but started first: the older; ratio 1, gap 0.5 us); SM 2 runs a single
    program (left out)."""
    progs = _us((0, 0, 10), (0, 0, 12), (0, 10, 20), (0, 12, 23), (1, 1, 9), (1, 0.5, 8.5), (2, 0, 7))
    got = wave_spread.resident_pairs(progs)
    assert [(sm, w) for sm, w, _, _ in got] == [(0, 1), (0, 2), (1, 1)]
    assert [r for _, _, r, _ in got] == pytest.approx([1.2, 1.1, 1.0])
    assert [g for _, _, _, g in got] == pytest.approx([0.0, 2.0, 0.5])
    with pytest.raises(Glm5labError, match=r"program 0 on SM 3 ends \(5000 ns\) before it starts"):
        wave_spread.resident_pairs(_us((3, 5, 5), (3, 6, 9)))
    with pytest.raises(Glm5labError, match="program 1 on SM 3 ends"):      # (the younger of a pair too)
        wave_spread.resident_pairs(_us((3, 5, 8), (3, 6, 4)))


def test_pair_table_reads_each_call_of_a_programs_csv(tmp_path, capsys):
    """Two calls of one form and shape written within the same second (one timestamp): told apart by their program
    numbers restarting at 0. In the first the younger program of every pair runs 10% longer, in the second 5%
    shorter; the table and `--pairs` say so per call and wave."""
    path = tmp_path / "programs.csv.gz"

    def call(scale):
        rows = []
        for sm in range(4):
            for wave in range(2):
                t0 = 20.0 * wave
                for k, dur in enumerate((10.0, 10.0 * scale)):
                    rows.append((sm, t0 + 0.1 * k, t0 + 0.1 * k + dur))
        return wave_spread.program_rows(_us(*rows), "glm5lab", "H16_T16_K2048", 8)

    wave_spread.write_programs(str(path), call(1.1), "test")
    wave_spread.write_programs(str(path), call(0.95), "test")
    table = wave_spread.pair_table(str(path))
    assert list(table["wave"]) == [1, 2, 1, 2] and set(table["sms"]) == {4}
    assert list(table["younger_slower"]) == [1.0, 1.0, 0.0, 0.0]
    assert list(table["ratio_p50"]) == pytest.approx([1.1, 1.1, 0.95, 0.95], rel=1e-3)
    assert list(table["gap_p50_us"]) == pytest.approx([0.1] * 4, abs=2e-3)
    assert wave_spread.main(["--pairs", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "younger_slower" in printed and "H16_T16_K2048" in printed
    assert wave_spread.main([]) == 1
    assert "--out is required (or --pairs PROGRAMS_CSV" in capsys.readouterr().err


def test_wave_spread_refuses_unknown_forms_and_bad_cases(tmp_path, capsys):
    out = tmp_path / "w.csv"
    assert wave_spread.main(["--out", str(out), "--case", "8:128"]) == 1
    assert "--case takes HEADS:TOKENS:FORM" in capsys.readouterr().err
    assert wave_spread.main(["--out", str(out), "--case", "8:128:nope"]) == 1
    assert "unknown form(s) ['nope']" in capsys.readouterr().err
    assert wave_spread.main(["--out", str(out), "--case", "8:128:glm5lab:2:1"]) == 1
    assert "--case takes HEADS:TOKENS:FORM[:SPLITS]" in capsys.readouterr().err
    assert wave_spread.main(["--out", str(out), "--case", "8:128:glm5lab:17"]) == 1
    assert "splits must be 1-16" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert wave_spread.main(["--out", str(out)]) == 1
        assert "needs a GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,resident", [(24, 1), (200, 2)], ids=["dual", "paired"])
def test_gpu_wave_stamps_leave_the_results_alone_and_respect_residency(device, tokens, resident):
    """16 heads fp8_ds_mla at 24 tokens (the dual kernel, one CTA a SM, the top-k split) and 200 (the paired kernel,
    two a SM), -1 slots among the rows: the stamped call's output and lse are the unstamped one's, bit for bit; every
    program wrote a start before its end and an SM id of this GPU; no SM ever runs more programs at once than the
    kernel's residency allows."""
    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
    from glm5lab.kernels.sparse_mla import STAMP_SLOTS, sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    gen = torch.Generator(device=device).manual_seed(44)
    cache = quantize_fp8_ds_mla(torch.randn(512, 64, 576, device=device, generator=gen).to(torch.bfloat16))
    q = torch.randn(tokens, 16, 576, device=device, generator=gen).to(torch.bfloat16)
    slots = torch.randint(0, 512 * 64, (tokens, 2048), device=device, dtype=torch.int32, generator=gen)
    slots[:, ::5] = -1
    cfg = {"impl": "gluon"}
    want = sparse_mla_attention(q, cache, slots, mla_softmax_scale(), _config=cfg)
    buf = torch.full((16 * tokens, STAMP_SLOTS.value), -1, dtype=torch.int64, device=device)   # (splits too)
    got = sparse_mla_attention(q, cache, slots, mla_softmax_scale(), _config={**cfg, "_stamps": (buf, None)})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    progs = wave_spread.programs_of(buf.tolist())
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert len(progs) % tokens == 0 and all(a < b for _, a, b in progs)     # (24 tokens: split, one wave)
    assert all(0 <= sm < num_sms for sm, _, _ in progs)
    for sm in {sm for sm, _, _ in progs}:
        mine = [p for p in progs if p[0] == sm]
        assert max(wave_spread.active_at(mine, a) for _, a, _ in mine) <= resident, sm
    parts = wave_spread.spread_parts(progs, num_sms * resident)
    assert 0 < parts["occupancy"] <= 1.0 and parts["end_last_us"] >= parts["end_p50_us"]


@pytest.mark.gpu
def test_gpu_wave_spread_writes_rows_programs_and_plot(tmp_path):
    out, progs, png = tmp_path / "w.csv", tmp_path / "p.csv.gz", tmp_path / "w.png"
    rows = wave_spread.run(str(out), str(progs), cases=((16, 136, "glm5lab"),), num_slots=65_536, verbose=False)
    got = {r["metric"]: r["value"] for r in rows}
    assert got["programs"] == 136 and got["time_graph"] > 0 and got["time_graph_stamped"] > 0
    wave_spread.plot(str(progs), str(png))
    assert png.stat().st_size > 10_000
