"""``chameleon simulate --plot``: what the figure shows, and the progress of long runs."""

from __future__ import annotations

import io
import math

import pytest
from sim_helpers import small_profile

from chameleon_megatron.cli import main
from chameleon_megatron.commands.simulate import ProgressLines
from chameleon_megatron.resilience.decision.profile import save_profile
from chameleon_megatron.sim.config import SimConfig
from chameleon_megatron.sim.plotting import DPI, plot_throughput
from chameleon_megatron.sim.simulator import simulate
from chameleon_megatron.sim.traces import Event

pytestmark = pytest.mark.timeout(60)

# two failures and one repair within the hour; the second repair comes after it
TRACE = (Event(600.0, "fail", 3), Event(1500.0, "fail", 9), Event(2400.0, "repair", 3),
         Event(5000.0, "repair", 9))
STRATEGIES = ("chameleon", "reroute", "replan", "checkpoint_restart", "redundant")


def tiny_config(**kw: object) -> SimConfig:
    base = dict(profile="-", tp=1, pp=2, dp=8, horizon_s=3600.0, mtbf_s=600.0,
                repair_s=1800.0)
    return SimConfig(**{**base, **kw})


def by_gid(artists, prefix: str) -> dict[str, object]:
    return {a.get_gid(): a for a in artists if (a.get_gid() or "").startswith(prefix)}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    report, results = simulate(tiny_config(), profile=small_profile(), events=TRACE)
    png = tmp_path_factory.mktemp("plot") / "sim.png"
    fig = plot_throughput(results, report["failure_free"]["throughput"], png, title="tiny",
                          events=TRACE)
    return report, results, fig, png


def test_three_panels_one_line_per_strategy_chameleon_on_top(drawn):
    report, results, fig, _ = drawn
    assert len(fig.axes) == 3  # event strip, throughput, averages
    lines = by_gid(fig.axes[1].get_lines(), "strategy:")
    assert sorted(lines) == sorted(f"strategy:{n}" for n in STRATEGIES)
    top = lines.pop("strategy:chameleon")
    assert top.get_zorder() > max(line.get_zorder() for line in lines.values())
    assert top.get_linewidth() > max(line.get_linewidth() for line in lines.values())


def test_throughput_never_drops_to_zero_downtime_is_a_gap(drawn):
    _, results, fig, _ = drawn
    for name, line in by_gid(fig.axes[1].get_lines(), "strategy:").items():
        ys = [float(y) for y in line.get_ydata()]
        assert all(y > 0 for y in ys if not math.isnan(y)), name
    # Chameleon is down at both failures (detection at least): two gaps
    ys = by_gid(fig.axes[1].get_lines(), "strategy:chameleon")["strategy:chameleon"].get_ydata()
    assert sum(math.isnan(y) for y in ys) >= 2


def test_failures_and_repairs_are_marked_within_the_horizon(drawn):
    _, _, fig, _ = drawn
    marks = by_gid(fig.axes[0].get_lines(), "events:")
    fail, repair = marks["events:fail"], marks["events:repair"]
    assert (fail.get_marker(), fail.get_color()) == ("x", "red")
    assert (repair.get_marker(), repair.get_color()) == ("^", "green")
    assert [x * 3600 for x in fail.get_xdata()] == pytest.approx([600.0, 1500.0])
    assert [x * 3600 for x in repair.get_xdata()] == pytest.approx([2400.0])


def test_averages_panel_has_one_labelled_bar_per_strategy(drawn):
    report, _, fig, _ = drawn
    bars = fig.axes[2]
    rects = bars.patches
    assert len(rects) == len(STRATEGIES)
    names = [t.get_text() for t in bars.get_yticklabels()]
    assert names[0] == "chameleon" and sorted(names) == sorted(STRATEGIES)
    avg = {n: report["strategies"][n]["avg_throughput"] for n in STRATEGIES}
    assert [r.get_width() for r in rects] == pytest.approx([avg[n] for n in names])
    texts = {t.get_text().split()[0] for t in bars.texts}
    assert texts == {f"{v:.1f}" for v in avg.values()}


def test_png_has_the_figure_size_and_is_not_blank(drawn):
    from matplotlib.image import imread

    _, _, fig, png = drawn
    pixels = imread(png)
    width, height = (fig.get_size_inches() * DPI).round().astype(int)
    assert pixels.shape[:2] == (height, width)
    box = fig.axes[1].get_window_extent()  # display pixels, origin bottom left
    area = pixels[height - int(box.y1):height - int(box.y0), int(box.x0):int(box.x1), :3]
    assert area.size > 0 and area.std() > 0.05


def test_progress_reports_every_strategy_up_to_the_end():
    seen: list[tuple[float, str]] = []
    cfg = tiny_config(strategies=("chameleon", "replan"))
    simulate(cfg, profile=small_profile(), events=TRACE,
             progress=lambda done, name: seen.append((done, name)))
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and 0 <= fractions[0] and fractions[-1] == 1.0
    # three events within the horizon per strategy, then the end
    assert [n for _, n in seen] == ["chameleon"] * 3 + ["replan"] * 4
    assert fractions[2] <= 0.5 <= fractions[3]


def test_progress_lines_are_throttled():
    ticks = iter([0.0, 0.5, 2.5, 3.0, 5.0])
    out = io.StringIO()
    lines = ProgressLines("1024", 2.0, out, clock=lambda: next(ticks))
    for done, name in ((0.1, "chameleon"), (0.4, "replan"), (0.5, "replan"), (0.9, "x")):
        lines(done, name)
    assert out.getvalue().splitlines() == ["simulating 1024: 40% (strategy replan)",
                                           "simulating 1024: 90% (strategy x)"]


def test_the_command_draws_and_reports_progress(tmp_path, capsys):
    save_profile(small_profile(), tmp_path / "small.json")
    (tmp_path / "tiny.yaml").write_text(
        "profile: small.json\ntp: 1\npp: 2\ndp: 8\nhorizon_s: 1800\nmtbf_s: 600\n"
        "strategies: [chameleon, replan]\n")
    png = tmp_path / "p.png"
    assert main(["simulate", "--preset", str(tmp_path / "tiny.yaml"), "--seed", "1",
                 "--plot", str(png), "--progress-s", "1e-9"]) == 0
    err = capsys.readouterr().err
    assert "simulating tiny: " in err and "(strategy replan)" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--preset", str(tmp_path / "tiny.yaml"), "--seed", "1",
                 "--progress-s", "0"]) == 0
    assert capsys.readouterr().err == ""
