"""A pytest run ends with its own summary, not triton's nanobind leak report (issue 59)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_collecting_prints_no_nanobind_leak_report():
    # test_compile.py imports torch._dynamo, which imports triton: the report came after it
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "tests/agent/test_flagged_checks.py", "tests/agent/test_compile.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "tests collected" in output
    assert "nanobind" not in output, output[-2000:]
