"""Every CUDA claim of the agent, checked in one run of under eight minutes on one GPU.

    python bench/gpu_check.py --out DIR            # on a machine with a CUDA device
    python bench/gpu_check.py --out DIR --smoke    # the same code paths on the CPU (< 2 min)

Groups (each row is printed as it is measured, and DIR/gpu_check.json and
DIR/gpu_check.md are rewritten after every row, so a run cut short still says what it
measured):
  0 device-path  tests/agent/test_cuda_device_path.py under pytest -m cuda (issue 62), first
  1 no-sync    each training recipe, 100 steps under torch.cuda.set_sync_debug_mode("error")
               with the agent attached (sampled steps and an overflow included)
  2 values     loss scale, skipped steps and grad norms against the check's own truth;
               forward/backward/optimizer times against torch.profiler (within 10%);
               peak memory per step against torch.cuda.max_memory_allocated
  3 overhead   GPT-2 small (124M), A/B in one process and per process, bf16 and fp16,
               eager and compiled, defaults and activations every step (target <= 1.01x)
  4 fp8        torchao Float8Linear with real FP8 (tensorwise, rowwise) against torchao's
               own cast, the FP8 suite's outlier scenario; Transformer Engine if it installs
  5 pages      the runs above on the local server; the GPT-2 run's pages answer
They run in the order 1, 2, 4 (torchao), 3, 4 (Transformer Engine, whose install may take
what time is left), 5.

Installs: only what is missing and needed (the server's dependencies, torchao, Transformer
Engine), from the registry, never torch (pinned by a constraint to the installed version).
The budget (--budget, 470 s; 100 s for --smoke) is enforced here: groups that would not
fit are reported as skipped, and an alarm stops the run at the budget, keeping the files.
Exit status: 0 when nothing failed, 1 when a check failed, 2 when cut short.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_report import Context

# the run's start; a run that re-executes itself after installing keeps its first start
T0 = float(os.environ.get("AMPWATCH_GPU_CHECK_T0", time.time()))
START = time.monotonic() - (time.time() - T0)
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

# what the check imports beyond torch and ampwatch: the server's stack (`ampwatch[server]`)
SERVER_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic_settings", "jinja2",
                  "plotly", "orjson", "zstandard", "prometheus_client", "httpx", "psycopg",
                  "fastapi_offline")


class OutOfTime(BaseException):
    """The budget's alarm went off. A BaseException, so that no `except Exception` on the
    way (the agent's guard, a check's own handler, dynamo's) swallows it."""


def _alarm(signum: int, frame: object) -> None:
    raise OutOfTime


def ensure_installed(out: Path, install: bool, deadline_s: float) -> list[str]:
    """Install what is missing (the server stack, ampwatch itself, pytest, torchao) with
    pip, torch pinned; returns what was done, in words."""
    constraints = out / "constraints.txt"
    constraints.write_text(f"torch=={importlib.metadata.version('torch')}\n")
    wanted = []
    if importlib.util.find_spec("ampwatch") is None or any(
            importlib.util.find_spec(m) is None for m in SERVER_MODULES):
        wanted += ["-e", f"{REPO}[server]"]
    # the check's local server is the test suite's (tests/conftest.py imports pytest), and
    # `pytest -m cuda` is the acceptance's second half (pytest-xdist: pyproject's addopts
    # name its -n)
    for module, package in (("pytest", "pytest"), ("xdist", "pytest-xdist"),
                            ("torchao", "torchao")):
        if importlib.util.find_spec(module) is None:
            wanted.append(package)
    if not wanted:
        return ["nothing to install"] if "AMPWATCH_GPU_CHECK_T0" not in os.environ else [
            os.environ.get("AMPWATCH_GPU_CHECK_INSTALLED", "")]
    if not install:
        return [f"missing, not installed (--no-install): {wanted}"]
    from gpu_report import pip_install

    command = [*pip_install(out), *wanted]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=deadline_s)
    except subprocess.TimeoutExpired:
        return [f"pip install {wanted}: not done within {deadline_s:.0f} s"]
    if done.returncode:
        return [f"pip install {wanted} failed: {done.stderr.strip().splitlines()[-1:]}"]
    if "AMPWATCH_GPU_CHECK_T0" not in os.environ:
        # an editable install's import hook loads at interpreter start: start again, once,
        # keeping the first start for the budget
        os.environ["AMPWATCH_GPU_CHECK_T0"] = str(T0)
        os.environ["AMPWATCH_GPU_CHECK_INSTALLED"] = f"installed {wanted}"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    return [f"installed {wanted}"]


def gpt2_batch(memory: int) -> int:
    """GPT-2 rows of 1024 tokens for a device of `memory` bytes (H100 80 GB: 16; H200: 32).
    By estimate, not yet measured: a bf16 step of batch 16 peaks near 25 GiB with the plain
    and the watched copy loaded (the fp32 logits and their grad are 6.6 GiB of it)."""
    gib = memory / 2**30
    return 32 if gib >= 120 else 16 if gib >= 70 else 8


def check_pages(ctx: Context) -> None:
    """Group 5: every run made above is on the server; the GPT-2 run's pages answer."""
    import httpx

    report, server, runs = ctx.report, ctx.server, ctx.runs
    if not runs:
        report.add("pages", "every run's overview page", "skip", "no run was made")
        report.add("pages", "GPT-2 run pages", "skip", "no GPT-2 run was made")
        return
    missing = [name for name, run in runs.items()
               if httpx.get(f"{server}/runs/{run}", timeout=30).status_code != 200]
    report.add("pages", "every run's overview page", "fail" if missing else "pass",
               f"{len(runs) - len(missing)}/{len(runs)} answer 200", "all", missing=missing)
    gpt2 = next((run for name, run in runs.items() if name.startswith("A/B")), None)
    if gpt2 is None:
        report.add("pages", "GPT-2 run pages", "skip",
                   "no GPT-2 run was made (the overhead group did not run, or ran out of time)")
        return
    answers = {path: httpx.get(f"{server}{path}", timeout=60) for path in (
        "/", f"/runs/{gpt2}", f"/runs/{gpt2}/layers", f"/runs/{gpt2}?format=json")}
    bad = {path: a.status_code for path, a in answers.items() if a.status_code != 200}
    listed = gpt2 in answers["/"].text
    report.add("pages", "GPT-2 run pages", "fail" if bad or not listed else "pass",
               f"{len(answers) - len(bad)}/{len(answers)} pages 200 (runs list, overview, "
               f"layers, JSON twin); run {'listed' if listed else 'not listed'}", "all",
               failed=bad, run=gpt2)


@contextlib.contextmanager
def local_server(url: str | None, out: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """`ampwatch serve` on a free port with its SQLite file in `out` (kept: the runs can be
    looked at after), started in a thread so that it boots while torch imports. Yields its
    URL and `ready()`, which waits for it to answer (raises if it did not start)."""
    if url:
        yield url, lambda: None
        return
    from tests.conftest import LiveServer

    os.environ["AMPWATCH_SPOOL_DIR"] = str(out / "spool")
    (out / "gpu_check.db").unlink(missing_ok=True)
    server = LiveServer(f"sqlite:///{out / 'gpu_check.db'}", out / "server.log")
    failed: list[BaseException] = []

    def start() -> None:
        try:
            server.start(timeout=120)
        except Exception as exc:  # noqa: BLE001 - raised in the main thread below
            failed.append(exc)

    def ready() -> None:
        starting.join()
        if failed:
            raise failed[0]

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    try:
        yield server.url, ready
    finally:
        starting.join()
        server.stop()


def run_checks(args: argparse.Namespace) -> int:
    from gpu_report import Budget

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget, START)
    installs = ensure_installed(out, args.install and not args.smoke,
                                min(90.0, budget.left() / 4))
    with local_server(args.server, out) as (server, ready):
        return _run_checks(args, budget, installs, server, ready)


def flagged_checks_state(device: Any) -> str:
    """Whether a run without a GradScaler takes the flagged kernel here (a healthy step
    reads no layer output) or checks every output (docs/agent.md, "Cheap by design")."""
    from ampwatch.agent.collectors import flagged_checks

    if not flagged_checks.available(device):
        return "off: the Triton kernel cannot run here; every layer output is checked"
    import triton
    return f"on (triton {triton.__version__}): held outputs, checked when the loss is bad"


DEVICE_PATH_TESTS = "tests/agent/test_cuda_device_path.py"  # issue 62's CUDA tests


def check_device_path(ctx: Context) -> None:
    """The accelerator path's CUDA tests first (`pytest -m cuda -n 0`, a few seconds):
    another device than the current one, hold_mb under checkpointing, float64, channels_last,
    FP8, side streams, variable shapes, CUDA graph capture. One row: pytest's summary."""
    if ctx.smoke:
        ctx.report.add("device-path", "pytest -m cuda " + DEVICE_PATH_TESTS, "skip",
                       "CUDA only (the CPU twins run in the suite: test_device_path.py)")
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-q",
                           "-p", "no:randomly", DEVICE_PATH_TESTS], cwd=REPO,
                          capture_output=True, text=True, timeout=max(30, ctx.budget.left() / 3))
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    ctx.report.add("device-path", "pytest -m cuda " + DEVICE_PATH_TESTS,
                   "pass" if done.returncode == 0 else "fail", summary[:300],
                   output=done.stdout[-4000:])


def _run_checks(args: argparse.Namespace, budget: Any, installs: list[str], server: str,
                ready: Callable[[], None]) -> int:
    import torch
    from gpu_report import Context, Report

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (smoke: CUDA checks skipped)"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    meta = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "mode": "smoke (CPU)" if args.smoke else "GPU", "python": sys.version.split()[0],
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average": os.getloadavg()[0], "budget_s": args.budget,
            "memory_gib": round(memory / 2**30, 1)}
    report = Report(Path(args.out), budget, meta)
    report.note("installs", installs)
    report.note("flagged_checks", flagged_checks_state(device))
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(budget.left())))
    from gpu_correctness import check_no_sync, check_values
    from gpu_fp8 import check_fp8, check_transformer_engine
    from gpu_overhead import check_overhead

    torch.manual_seed(0)
    if not cuda:
        torch.set_num_threads(1)
    try:
        try:
            ready()
        except Exception as exc:  # noqa: BLE001 - nothing can be checked without it
            report.add("server", "local ampwatch server", "fail",
                       f"{type(exc).__name__}: {exc}"[:300], log=str(Path(args.out) / "server.log"))
            return 1
        ctx = Context(device, args.smoke, report, budget, server,
                      # the smoke: the no-sync recipes' batch, so the compiled A/B reuses
                      # their compiled graph
                      batch=args.batch or gpt2_batch(memory) if cuda else 4)
        report.note("server", server)
        install_te = args.install and not args.smoke
        groups = [("device-path", check_device_path), ("no-sync", check_no_sync),
                  ("values", check_values), ("fp8", check_fp8), ("overhead", check_overhead),
                  ("fp8", lambda c: check_transformer_engine(c, install_te)),
                  ("pages", check_pages)]
        for group, check in groups:
            if group not in args.groups:
                continue
            try:
                check(ctx)
            except OutOfTime:
                raise
            except Exception as exc:  # noqa: BLE001 - one group's crash is its row
                report.add(group, "(group)", "fail", f"{type(exc).__name__}: {exc}"[:300],
                           traceback=traceback.format_exc()[-2000:])
    except OutOfTime:
        report.note("interrupted", f"budget of {args.budget:.0f} s reached; later checks "
                                   "did not run")
        return 2
    finally:
        signal.alarm(0)
    return 1 if report.failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check_out", help="folder for the report files")
    parser.add_argument("--smoke", action="store_true", help="the CPU run of the same paths")
    parser.add_argument("--budget", type=float, default=None,
                        help="wall seconds for the whole run (default 470; 100 with --smoke)")
    parser.add_argument("--groups", default="device-path,no-sync,values,fp8,overhead,pages")
    parser.add_argument("--no-install", dest="install", action="store_false",
                        help="install nothing, report what is missing")
    parser.add_argument("--server", default=None, help="send to this server, not a local one")
    parser.add_argument("--batch", type=int, default=None, help="GPT-2 batch rows")
    # one process of the per-process overhead comparison (internal)
    parser.add_argument("--overhead-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead_worker:
        from gpu_overhead import overhead_worker

        overhead_worker(args.overhead_worker, args.precision, args.steps, args.warmup,
                        args.server, args.batch, args.smoke)
        return
    if args.budget is None:
        args.budget = 100.0 if args.smoke else 470.0
    args.groups = set(args.groups.split(","))
    sys.exit(run_checks(args))


if __name__ == "__main__":
    main()
