"""`meshplan plan --report DIR`: every file, plots that say what they show, an HTML page
that renders offline in headless Chromium, and the gallery that regenerates the same plans."""
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT
from gallery_plans import gallery_plan
from planner.config import ParallelConfig
from planner.describe import cost_per_million_tokens
from planner.report.gallery import SCENARIOS

QUICK_START = ["--model", "gpt3-175b", "--cluster", "a100-80g", "--gpus", "1024", "--global-batch", "1536"]
PLOTS = {   # plot -> strings it must show: title words, axis labels with units, legend entries
    "memory_per_stage": ["Memory per GPU", "pipeline stage", "memory per GPU (GiB)", "device capacity (80 GiB)",
                         "parameters", "gradients", "optimizer states", "activations"],
    "pipeline_timeline": ["One step", "time within the step (s)", "pipeline stage", "forward", "backward",
                          "optimizer step", "data-parallel collective"],
    "step_breakdown": ["Where the step", "seconds per step", "compute", "pipeline bubble",
                       "exposed data-parallel communication", "optimizer step"],
    "candidates": ["Top candidates", "seconds per step", "candidate (winner first)", "tokens/s", "winner: "],
}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def quick_start_report(tmp_path_factory):
    """The report of the README's Quick start scenario, written by the CLI."""
    from conftest import run_cli
    folder = tmp_path_factory.mktemp("report")
    out = run_cli("plan", *QUICK_START, "--report", str(folder), timeout=600)
    assert out.returncode == 0, out.stderr
    return folder


def test_report_has_every_file(quick_start_report):
    d = quick_start_report
    for name in ("plan.json", "report.md", "report.html"):
        assert (d / name).stat().st_size > 1000, name
    for plot in PLOTS:
        for ext in ("png", "svg"):
            assert (d / "plots" / f"{plot}.{ext}").stat().st_size > 5000, (plot, ext)
    exports = sorted(p.name for p in (d / "exports").iterdir())
    assert exports == ["NOTES.md", "colossalai_plugin.py", "deepspeed_config.json", "megatron_args.txt",
                       "meshplan_run.sh", "meshplan_sbatch.sh", "torchtitan.toml", "torchtitan_config.py"]
    plan = json.loads((d / "plan.json").read_text())
    assert plan["schema_version"] == 2 and plan["alternatives"] and plan["closed_form_step_time_s"] > 0


def test_plots_label_their_axes_units_and_legends(quick_start_report):
    pp = json.loads((quick_start_report / "plan.json").read_text())["config"]["pp"]
    for plot, needed in PLOTS.items():
        svg = (quick_start_report / "plots" / f"{plot}.svg").read_text()
        # the timeline has a row per pipeline stage: the last one is labelled
        for text in needed + ([f"stage {pp - 1}"] if plot == "pipeline_timeline" else []):
            assert text.replace("&", "&amp;") in svg, (plot, text)


def test_report_explains_the_plan(quick_start_report):
    md = (quick_start_report / "report.md").read_text()
    plan = json.loads((quick_start_report / "plan.json").read_text())
    for heading in ("## Summary", "## Where the time goes", "## Where the memory goes", "## Why this plan",
                    "## When nodes fail", "## Exports"):
        assert heading in md
    # 1,016 GPUs (127 nodes, a prime) split no global batch of 1,536; 1,008 do, under another layout
    assert "| 127 | 1016 | no legal configuration exists for these knobs | - | - |" in md
    assert re.search(r"\| 126 \| 1008 \| dp\d+ tp\d+ pp\d+ .* \| \+[0-9.]+% \|", md)
    assert "see a failure every 49.5 hours" in md and "Daly 2006" in md and "Young 1974" in md
    assert "What limits it: memory" in md and "Next knob to turn:" in md
    assert md.count("| dp") >= len(plan["alternatives"])           # a row per runner-up, with what it lost on
    assert f"{plan['estimate']['step_time_s']:.3f} s" in md
    for plot in PLOTS:
        assert f"(plots/{plot}.png)" in md


def self_contained(html: str) -> list[str]:
    """Attributes that would load something from outside the page (none may)."""
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", html)
    refs += re.findall(r"""url\(\s*["']?([^)"']+)""", html)
    return [r for r in refs if not r.startswith(("#", "data:"))]


def render_in_chromium(path: Path) -> tuple[str, list[str]]:
    """(the DOM after loading, console messages) from headless Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is needed for this test: apt-get install -y chromium (see the README's Quick start)"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
                              "--v=0", "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.browser
def test_report_html_renders_in_chromium_without_console_errors(quick_start_report, tmp_path):
    page = quick_start_report / "report.html"
    assert self_contained(page.read_text()) == []
    dom, console = render_in_chromium(page)
    assert console == []
    # Summary, where the time and the memory go, why this plan, stages, when nodes fail, exports, search
    assert dom.count("<svg") >= len(PLOTS) and dom.count("<h2>") == 8
    assert "Why this plan" in dom and "device capacity" in dom and "When nodes fail" in dom
    # the same check does see a broken page
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><html><body><script>undefined_function()</script></body></html>")
    _, console = render_in_chromium(broken)
    assert any("undefined_function" in line for line in console)
    assert self_contained('<img src="plots/x.png"><a href="#s">') == ["plots/x.png"]


def test_cost_per_million_tokens():
    # 8 GPUs at $4.916 an hour each, 10,000 tokens/s: $39.328 buys 36 M tokens
    assert cost_per_million_tokens(4.916, 8, 10_000) == pytest.approx(39.328 / 36)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_regenerating_the_gallery_gives_the_same_plans(scenario):
    committed = json.loads((ROOT / "reports" / scenario.name / "plan.json").read_text())
    plan = gallery_plan(scenario.name)
    fresh = plan.to_json()
    read = ParallelConfig.from_json     # reads the names plan.json files written earlier use, too
    assert read(fresh["config"]) == read(committed["config"])
    assert fresh["stages"] == committed["stages"]
    assert fresh["estimate"]["step_time_s"] == pytest.approx(committed["estimate"]["step_time_s"], rel=1e-9)
    assert [read(a["config"]) for a in fresh["alternatives"]] == [read(a["config"]) for a in committed["alternatives"]]
    assert (ROOT / "reports" / scenario.name / "report.html").exists()
    assert f"({scenario.name}/report.md)" in (ROOT / "reports" / "README.md").read_text()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_gallery_sets_each_plan_against_its_published_layout(scenario):
    from planner.report.gallery import published_comparison
    cmp = published_comparison(scenario, gallery_plan(scenario.name))
    md = (ROOT / "reports" / scenario.name / "report.md").read_text()
    start = md.index("## Your plan against the recommended one")
    section = md[start:md.index("\n## ", start + 1)]
    assert f"reports/baselines/{scenario.baseline}" in section
    assert f"| step time (s) | {cmp.mine.estimate.step_time_s:.3f} |" in section
    assert "plots/comparison.png" in section and (ROOT / "reports" / scenario.name / "plots" / "comparison.svg").exists()
    index = (ROOT / "reports" / "README.md").read_text()
    assert f"[{scenario.published}]({scenario.name}/report.md#your-plan-against-the-recommended-one)" in index
