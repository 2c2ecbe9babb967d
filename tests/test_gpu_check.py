"""bench/gpu_check.py --smoke: the GPU acceptance script runs every one of its code paths on
the CPU, so it cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE_LIMIT_S = 120  # the "under two minutes"

pytest.importorskip("torchao", reason="torchao (ampwatch[fp8]) is not installed")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, float, dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True,
                          timeout=SMOKE_LIMIT_S + 60, cwd=ROOT)
    elapsed = time.monotonic() - started
    report = json.loads((out / "gpu_check.json").read_text())
    return done.returncode, elapsed, report, (out / "gpu_check.md").read_text(), done.stdout


def test_smoke_run_passes_within_two_minutes(smoke) -> None:
    code, elapsed, report, _, stdout = smoke
    failed = [(r["check"], r["figure"]) for r in report["rows"] if r["status"] == "fail"]
    assert failed == [] and code == 0, stdout[-3000:]
    assert elapsed < SMOKE_LIMIT_S
    assert not report["meta"].get("interrupted")
    # whether the runs without a scaler took the flagged kernel: the report says which
    assert report["meta"]["flagged_checks"].startswith(("on (triton", "off: "))


def test_smoke_run_reaches_every_check(smoke) -> None:
    """Every check has its row, and every group ran its code path: only the costliest
    overhead rows (per process, compiled) may give way to the budget on a busy machine."""
    _, _, report, _, _ = smoke
    rows = report["rows"]
    out_of_time = {r["check"] for r in rows if r["figure"].startswith("out of time")}
    assert out_of_time <= {"per process bf16 eager defaults", "A/B bf16 compiled defaults"}
    checks = {(r["group"], r["check"]) for r in rows}
    for recipe in ("fp16_scaler", "deprecated_cuda_scaler", "bf16", "accumulation", "compiled",
                   "fp8_torchao"):
        assert ("no-sync", recipe) in checks
    groups = {r["group"] for r in rows}
    assert groups == {"device-path", "no-sync", "values", "overhead", "fp8", "pages"}
    overhead = {r["check"] for r in rows if r["group"] == "overhead"}
    assert overhead == {f"A/B {p} eager {s}" for p in ("bf16", "fp16")
                        for s in ("defaults", "activations every step")} | {
        "A/B bf16 compiled defaults", "A/B fp16 compiled defaults",
        "per process bf16 eager defaults"}


def test_cuda_only_checks_are_skipped_with_the_reason(smoke) -> None:
    _, _, report, markdown, stdout = smoke
    rows = report["rows"]
    skipped = {r["check"]: r["figure"] for r in rows if r["status"] == "skip"
               and not r["figure"].startswith("out of time")}  # see the test above
    assert all("CUDA" in why or why.startswith("smoke:") for why in skipped.values()), skipped
    assert {"peak memory per step (fp16 GradScaler)", "Transformer Engine (delayed scaling)",
            "fp16_scaler"} <= set(skipped)
    # what the CPU can check, it checks: the profiler comparison, values, FP8, pages
    passed = {r["check"] for r in rows if r["status"] == "pass"}
    assert {"forward time vs torch.profiler (host clock)",
            "loss scale and skipped steps (fp16)", "outlier scenario (tensorwise)",
            "GPT-2 run pages"} <= passed
    # the table printed as it went and the markdown file carry every row
    assert all(r["check"] in stdout and r["check"] in markdown for r in rows)


def test_a_run_cut_short_still_says_what_it_measured(tmp_path: Path) -> None:
    """The budget is the script's own: what does not fit is skipped as out of time, or the
    alarm stops the run; either way both files hold every row measured until then."""
    budget = 25
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke",
                           # the overhead group alone outlasts the budget on any machine
                           "--budget", str(budget), "--groups", "no-sync,overhead,pages",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=budget + 60, cwd=ROOT)
    assert time.monotonic() - started < budget + 30  # the alarm, then the server's stop
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    cut = report["meta"].get("interrupted") or any(
        r["figure"].startswith("out of time") for r in rows)
    assert cut and done.returncode in (0, 2)
    assert (done.returncode == 2) == bool(report["meta"].get("interrupted"))
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(r["check"] in markdown for r in rows)


def test_profile_names_the_agents_handlers(tmp_path: Path) -> None:
    """bench/gpu_profile.py on the CPU (a tiny model): both copies timed, and the agent's
    handlers labelled, so the GPU window's profile cannot rot."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_profile.py"),
                           "--out", str(tmp_path), "--steps", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "gpu_profile.md").read_text()
    assert "| plain |" in report and "| watched |" in report
    for handler in ("aw.watch._step_end", "aw.grads.on_grads", "aw.timing.on_step_end"):
        assert f"| {handler} |" in report, handler
