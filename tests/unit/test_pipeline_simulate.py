"""Simulator semantics (latency, FB, local V bottom, memory) and the command line."""
import json
import subprocess
import sys

import pytest

from parallel.pipeline import Action, ActionKind, Costs, build
from parallel.pipeline.ir import Placement, Schedule
from parallel.pipeline.simulate import main
from parallel.pipeline.timeline import simulate


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_single_microbatch_pays_latency_on_every_crossing(ranks):
    costs = Costs(f=1.0, b=1.5, w=0.5, comm=0.25)
    timeline = simulate(build("1f1b", ranks, 1), costs)
    hops = 2 * (ranks - 1)
    compute = ranks * (costs.f + costs.b + costs.w)
    assert timeline.makespan == pytest.approx(compute + hops * costs.comm)


def test_v_bottom_and_single_rank_edges_are_local():
    timeline = simulate(build("zbv", 1, 3), Costs(comm=5.0))
    assert timeline.bubble == pytest.approx(0.0)


def test_fb_runs_both_halves_in_one_slot_of_its_own_cost():
    schedule = Schedule(
        "t",
        Placement("loop", 1, 1),
        2,
        ((
            Action(ActionKind.F, 0, 0),
            Action(ActionKind.FB, 0, 1, b_kind=ActionKind.BW, b_stage=0, b_microbatch=0),
            Action(ActionKind.BW, 0, 1),
        ),),
    )
    timeline = simulate(schedule, Costs(fb=1.5))
    assert timeline.end[0] == pytest.approx((1.0, 2.5, 4.5))
    assert timeline.peak_activations == (2.0,)


def test_busy_counts_every_stage_and_microbatch_once():
    ranks, microbatches = 4, 12
    for name in ("dualpipe", "dualpipev", "zbv"):
        schedule = build(name, ranks, microbatches)
        per_rank = schedule.num_stages * microbatches * 3.0 / ranks
        assert simulate(schedule).busy == (per_rank,) * ranks


def _cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().out


def test_cli_json_reports_makespan_bubble_busy_and_memory(capsys):
    code, out = _cli(capsys, "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["bubble"] == pytest.approx(3 * 3.0)
    assert report["makespan"] == pytest.approx(8 * 3.0 + 3 * 3.0)
    assert report["busy"] == [24.0] * 4
    assert report["peak_activations"] == [4.0, 3.0, 2.0, 1.0]
    assert len(report["span_bubble"]) == 4


def test_cli_costs_reach_the_simulation(capsys):
    _, out = _cli(
        capsys, "--schedule", "zb-h1", "--ranks", "8", "--microbatches", "24",
        "--cost-b", "1.2", "--cost-w", "0.8", "--json",
    )
    assert json.loads(out)["bubble"] == pytest.approx(7 * (1.0 + 1.2 - 0.8))
    _, out = _cli(
        capsys, "--schedule", "dualpipev", "--ranks", "4", "--microbatches", "10",
        "--cost-fb", "2.4", "--json",
    )
    assert json.loads(out)["bubble"] == pytest.approx(3 * (2.4 + 2.0 - 3.0))


def test_cli_text_output_and_parameter_errors(capsys):
    _, out = _cli(capsys, "--schedule", "zbv", "--ranks", "2", "--microbatches", "4")
    assert "bubble" in out and "peak_activations" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--schedule", "dualpipe", "--ranks", "3", "--microbatches", "12"])
    assert exit_info.value.code == 2
    assert "ranks:" in capsys.readouterr().err


def test_cli_plot_writes_a_small_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "dualpipe.png"
    _cli(
        capsys, "--schedule", "dualpipe", "--ranks", "4", "--microbatches", "8",
        "--plot", str(out),
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) < 100_000


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "parallel.pipeline.simulate", "--schedule", "zb-h2",
         "--ranks", "2", "--microbatches", "4", "--json"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert json.loads(result.stdout)["schedule"] == "zb-h2"
