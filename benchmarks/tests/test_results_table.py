"""The README's results table is generated from a `make bench` run (`benchmarks/results_table.py`):
a pure function of the run's JSON, written between markers the README keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import results_table

ROOT = Path(__file__).resolve().parents[2]


def _case(link: str, ours: float, lerobot: float, floor: float, shm: float | None = None) -> dict:
    systems = {"ours": {"added_ms": {"p50": ours}, "link_kb_per_rt": 131.0},
               "lerobot": {"added_ms": {"p50": lerobot}, "link_kb_per_rt": 1923.0},
               "floor": {"added_ms": {"p50": floor}, "link_kb_per_rt": 131.0}}
    if shm is not None:
        systems["ours_shm"] = {"added_ms": {"p50": shm}, "link_kb_per_rt": 1.0}
    return {"workload": "cam2_480x640", "link": link, "systems": systems}


RESULTS = {
    "latency": {"cases": [_case("loopback", 3.92, 17.24, 0.29, shm=1.29), _case("wifi", 15.2, 78.58, 9.29),
                          {**_case("loopback", 1.0, 2.0, 0.1), "workload": "cam1_224x224"}]},
    "control_loop": {"seconds_per_phase": 20.0, "systems": {
        "ours": {"up": {"handover_us": {"p99": 52.0}, "late_steps": 0}, "gone": {"late_steps": 0}},
        "lerobot": {"up": {"handover_us": {"p99": 12761.0}, "late_steps": 0}, "gone": {"late_steps": 151}}}},
    "ingest": {"stages": [
        {"system": "ours", "clients": 100, "server_cores": 0.6, "keeps_up": True},
        {"system": "floor", "clients": 100, "server_cores": 0.37, "keeps_up": True},
        {"system": "lerobot", "clients": 10, "server_cores": 0.47, "keeps_up": False},
        {"system": "lerobot", "clients": 100, "skipped": "did not keep up with 10 clients"}]},
}
MACHINE = {"cores": 2, "cpu": "Intel Xeon", "date": "2026-11-23 08:05:00 UTC", "git_commit": "a0ea77d",
           "load_avg_at_start": [0.4, 0.3, 0.2], "versions": {"eclipse-zenoh": "1.10.2", "lerobot": "0.6.1"}}


def test_the_table_holds_the_main_workloads_figures_side_by_side_with_their_ratios():
    text = results_table.block(RESULTS, MACHINE, "make bench")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| **1.29** | 17.24 | 0.29 | 13.4× |" in rows["added latency, same host (ms, median)"]
    assert "| **3.92** | 17.24 | 0.29 | 4.4× |" in rows["added latency, loopback, network path (JPEG) (ms, median)"]
    assert "| **15.20** | 78.58 | 9.29 | 5.2× |" in text  # the Wi-Fi-like link, named by its shape
    assert "1.00" not in text  # another workload's figures stay out
    assert "| **52** | 12761 | — | 245× |" in rows["control loop blocked per hand-over (µs, p99)"]
    assert "| **0 / 0** | 0 / 151 |" in text
    assert "| **0.60** | not run (did not keep up with 10 clients) | 0.37 |" in text
    assert "`make bench` on 2026-11-23 08:05:00 UTC at commit `a0ea77d`: 2 cores (Intel Xeon)" in text
    assert "load average 0.40 as it ended" in text and "docs/benchmarks.md" in text
    assert "loaded machine" not in text


def test_a_run_on_a_loaded_machine_says_so_under_the_table():
    text = results_table.block(RESULTS, {**MACHINE, "load_avg_at_start": [7.9, 7.0, 4.7]}, "make bench")
    last = text.splitlines()[-1]
    assert "**Measured on a loaded machine** (load average 7.9 on 2 cores)" in last
    assert "hold better" not in text and "not the figures to quote" in last


def test_a_loaded_run_does_not_rewrite_the_readme_unless_allowed_and_then_marked(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{results_table.BEGIN}\nOLD\n{results_table.END}\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latency.json").write_text(__import__("json").dumps(RESULTS["latency"]))
    loaded = {**MACHINE, "load_avg_before": [3.1, 2.0, 1.0]}  # quiet as it ended, loaded as it started
    (tmp_path / "run" / "summary.json").write_text(__import__("json").dumps({"machine": loaded}))
    assert results_table.main([str(tmp_path / "run"), "--write", str(readme)]) == 1
    assert "OLD" in readme.read_text() and "load average 3.1 on 2 cores" in capsys.readouterr().err
    assert results_table.main([str(tmp_path / "run"), "--write", str(readme), "--allow-loaded"]) == 0
    assert "OLD" not in readme.read_text() and "**Measured on a loaded machine**" in readme.read_text()
    quiet = {**MACHINE, "load_avg_before": [0.5, 0.4, 0.3]}
    assert results_table.write_checked(readme, "NEW", quiet) is None and "NEW" in readme.read_text()


def test_a_figure_the_run_did_not_measure_is_a_dash_not_a_stale_number():
    text = results_table.block({"latency": {"cases": [_case("loopback", 3.0, 30.0, 0.3)]}}, {}, "make bench")
    assert "| **3.00** | 30.00 | 0.30 | 10.0× |" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 3  # the header, the loopback row and its bytes
    assert not any(word in line for line in table for word in ("same host", "hand-over", "cores"))


def test_write_replaces_only_the_block_and_the_readme_has_one(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert readme.count(results_table.BEGIN) == 1 and readme.count(results_table.END) == 1
    assert readme.index(results_table.BEGIN) < readme.index(results_table.END)
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    results_table.write(copy, "NEW TABLE")
    head, rest = readme.split(results_table.BEGIN)
    tail = rest.split(results_table.END, 1)[1]
    assert copy.read_text() == f"{head}{results_table.BEGIN}\nNEW TABLE\n{results_table.END}{tail}"


def test_make_bench_refuses_a_readme_without_the_block_before_it_runs_anything(tmp_path, capsys):
    from benchmarks import run_all

    readme = tmp_path / "README.md"
    readme.write_text("# no table here\n")
    with pytest.raises(SystemExit) as exit_:
        run_all.main(["--write-readme", str(readme), "--out", str(tmp_path / "out"), "--only", "latency"])
    assert exit_.value.code == 2 and "has no results block" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
