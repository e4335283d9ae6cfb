"""benchmarks/report.py regenerates RESULTS.md from the committed raw JSON
(no engine: matplotlib only)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interpolate_between_and_beyond_points(report):
    points = [{"rows": 1, "loop_ms": 10.0}, {"rows": 4, "loop_ms": 13.0}, {"rows": 8, "loop_ms": 21.0}]
    assert report.interpolate(points, 1) == 10.0
    assert report.interpolate(points, 2) == pytest.approx(11.0)
    assert report.interpolate(points, 6) == pytest.approx(17.0)
    assert report.interpolate(points, 12) == pytest.approx(29.0)  # the last slope, extended


def test_arm_names_parse(report):
    assert report.arm_kind("loopspec d2 K4") == ("loopspec", 2, 4)
    assert report.arm_kind("ngram K8") == ("ngram", None, 8)
    assert report.arm_kind("suffix") == ("suffix", None, None)


def test_page_regenerates_from_committed_results(report, tmp_path, monkeypatch):
    committed = ROOT / "benchmarks" / "results"
    if not (committed / "kv_sweep.json").exists():
        pytest.skip("no committed kv_sweep.json")
    results = tmp_path / "results"
    shutil.copytree(committed, results, ignore=shutil.ignore_patterns("plots"))
    monkeypatch.setattr(report, "RESULTS", results)
    monkeypatch.setattr(report, "PLOTS", results / "plots")
    monkeypatch.setattr(report, "PAGE", tmp_path / "RESULTS.md")
    report.main()
    page = (tmp_path / "RESULTS.md").read_text()
    # every loopspec arm of the sweep, the peers and the native baseline appear
    sweep = report.load("kv_sweep.json")
    for setting in sweep["results"].values():
        for arms in setting.values():
            for name in arms:
                assert f"| {name} |" in page or f"| **{name}** |" in page
    for plot in ("speedup_vs_k_short.png", "acceptance_per_position.png"):
        assert (results / "plots" / plot).stat().st_size > 1000
    assert "## How to rerun" in page


def test_burst_ratios_are_paired_by_repeat(report):
    def run(*rates):
        return {"windows": {w: {"tokens_per_s": r} for w, r in zip(("before", "burst", "after"), rates)}}

    rec = {"runs": {"native": [run(100, 1000, 0.0), run(50, 500, 100)],
                    "loopspec adaptive": [run(150, 900, 80), run(100, 600, 150)]}}
    assert report.burst_paired_ratios(rec, "burst") == pytest.approx([0.9, 1.2])
    # the medians' ratio (750/750 = 1.0) would hide that one repeat lost 10%
    assert report.burst_paired_ratios(rec, "before") == pytest.approx([1.5, 2.0])
    assert report.burst_paired_ratios(rec, "after") == pytest.approx([1.5])  # a window native never reached


def test_burst_section_shows_the_second_native_as_the_noise_floor(report):
    def run(burst):
        return {"windows": {w: {"tokens_per_s": r} for w, r in zip(("before", "burst", "after"), (100, burst, 100))}}

    summary = {f"{w}_tokens_per_s": {"native": 100, "loopspec adaptive": 100} for w in ("before", "burst", "after")}
    summary |= {f"{w}_speedup_median": 1.0 for w in ("before", "burst", "after")}
    rec = {"command": "c", "when": "w", "engine": "e", "summary": summary,
           "workload": {"greedy_tokens": 9, "burst_after_tokens": 2, "burst": 16, "burst_temperature": 0.8,
                        "burst_tokens": 9},
           "runs": {"native": [run(1000), run(500)], "loopspec adaptive": [run(900), run(600)]}}
    plain = "\n".join(report.burst_section(rec))
    assert "twin" not in plain  # a record from before the twin: the table it always had
    rec["runs"]["native twin"] = [run(1100), run(450)]
    rec["summary"] |= {f"{w}_twin_ratio_median": 0.97 for w in ("before", "burst", "after")}
    table = [line for line in report.burst_section(rec) if line.startswith("| burst")]
    # adaptive over the geometric mean of the natives around it: 900/sqrt(1000*1100), 600/sqrt(500*450)
    assert report.burst_sandwich_ratios(rec, "burst") == pytest.approx([0.8581, 1.2649], abs=1e-4)
    assert table == ["| burst | 100 | 100 | 1.00× | 1.05× (0.90–1.20×) | 0.97× | 1.00× (0.90–1.10×) "
                     "| 1.06× | 1.062 ± 0.203 |"]


def test_twin_of_the_best_fixed_arm_is_scored_over_every_assignment_of_the_natives_spread(report):
    def trials(*rates):
        return [{"tokens_per_s": r} for r in rates]

    steady = {"native": trials(100, 100, 100), "native (second engine)": trials(100, 100, 100),
              "best": trials(200, 210, 190)}
    assert report.twin_within(steady, "best") == 1.0  # two natives agree: a twin matches exactly
    spread = {"native": trials(100, 100, 100), "native (second engine)": trials(90, 100, 100),
              "best": trials(200, 200, 200)}
    # Twin trials are 180 or 200 each; its median is 180 (within 5% of 200: no) when two or three
    # of the three take the slow repeat: 3·(1/3)²·(2/3) + (1/3)³ = 7/27.
    assert report.twin_within(spread, "best") == pytest.approx(1 - 7 / 27)
    assert report.twin_within({"best": trials(1, 2)}, "best") is None


def test_twin_of_many_repeats_is_scored_over_a_sample_of_assignments(report):
    """9 repeats: 9^9 assignments would not fit in memory; a seeded sample
    of them estimates the same probability."""
    def trials(*rates):
        return [{"tokens_per_s": r} for r in rates]

    # One slow repeat in three (90 against 100): the twin's median falls short
    # when five or more of its nine trials take it.
    record = {"native": trials(*[100] * 9), "native (second engine)": trials(*[90, 100, 100] * 3),
              "best": trials(*[200] * 9)}
    from math import comb
    exact = sum(comb(9, j) * (1 / 3) ** j * (2 / 3) ** (9 - j) for j in range(5, 10))
    assert 9 ** 9 > report.TWIN_ASSIGNMENTS
    assert report.twin_within(record, "best") == pytest.approx(1 - exact, abs=0.01)
    assert report.twin_within(record, "best") == report.twin_within(record, "best")  # seeded


def test_auto_is_also_scored_against_the_native_trial_beside_it(report):
    """kv_sweep --native-beside-auto runs native just before each auto
    trial: the auto arm's ratio to those, paired by repeat, is a column and
    a count of its own, beside the ratio of medians to the rotated native."""
    def trials(*rates):
        return [{"tokens_per_s": r} for r in rates]

    def summary(rates):
        return {"median_tokens_per_s": sorted(rates)[len(rates) // 2]}

    arms = {"native": (100, 110, 120), "loopspec d1 K2": (90, 95, 100), "loopspec d1 auto": (97, 100, 103),
            "native (beside loopspec d1 auto)": (100, 100, 100)}
    row = {name: summary(rates) for name, rates in arms.items()}
    row["loopspec d1 auto"]["vs_native_beside"] = 1.0  # kv_sweep's median of 97/100, 100/100, 103/100
    rec = {"command": "kv_sweep", "when": "now", "repeats": 3, "engine": "test", "machine_load": [0, 0, 0],
           "arms": {name: None for name in arms}, "results": {"short": {"8": row}},
           "raw": {"short": {"8": {name: trials(*rates) for name, rates in arms.items()}}}}
    lines = report.adaptive_section(rec)
    table = [line for line in lines if line.startswith("| short")]
    assert table[0].endswith(" 1.00× |")  # against the trials beside it; 0.91× against the rotated native
    assert "**0.91×**" in table[0]
    assert any("≥ 0.97× in 1 of 1 cells" in line and "beside" in line for line in lines)
    header = next(line for line in lines if line.startswith("| cell"))
    assert header.count("|") == table[0].count("|")


def test_the_per_step_depth_engine_is_scored_on_its_own(report):
    """kv_sweep --auto-depths: the engine choosing each step's depth is one
    arm, scored against native and the best fixed (d, K) without a depth
    picked per cell; it stays out of auto's best-of-d."""
    def trials(*rates):
        return [{"tokens_per_s": r} for r in rates]

    def summary(rates):
        return {"median_tokens_per_s": sorted(rates)[len(rates) // 2]}

    arms = {"native": (100, 100, 100), "loopspec d2 K4": (120, 120, 120), "loopspec d1 auto": (130, 130, 130),
            "loopspec d2 auto": (90, 90, 90), "loopspec per-step d1,2": (96, 96, 96)}
    row = {name: summary(rates) for name, rates in arms.items()}
    rec = {"command": "kv_sweep", "when": "now", "repeats": 3, "engine": "test", "machine_load": [0, 0, 0],
           "arms": {name: None for name in arms}, "results": {"short": {"8": row}},
           "raw": {"short": {"8": {name: trials(*rates) for name, rates in arms.items()}}}}
    lines = report.per_step_depth_section(rec)
    table = [line for line in lines if line.startswith("| short")]
    assert table == ["| short | 8 | **0.96×** (0.96×) | 0.80× (0.80×, d2 K4) | 0.74× (0.74×, d1 auto) |"]
    assert any("≥ 0.97× native in 0 of 1 cells (paired 0); within 5% of the best fixed (d, K) in 0 of 1 "
               "(paired 0)" in line for line in lines)
    assert any("**1.30×**" in line for line in report.adaptive_section(rec))  # best of d: d1 auto, not per-step
    assert report.per_step_depth_section({**rec, "results": {"short": {"8": {
        n: r for n, r in row.items() if not n.startswith("loopspec per-step")}}}}) == []
