"""`ampwatch replay BUNDLE --model module:factory [--device cpu|cuda] [--bisect]`, or
`ampwatch replay --run RUN --step STEP [--rank R] ...` for a bundle on the server.

Registered through the `ampwatch.cli` entry point; torch is imported only when the
command runs, so the rest of the CLI stays free of it. A bisect of a bundle of a server
(pulled by --run, or a file when --server or $AMPWATCH_SERVER names one) records its
verdict there (replay/remote.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import pickle
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ampwatch.client.render import printable
from ampwatch.replay.remote import BundleOrigin, origin_of, pull, record_verdict


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "replay", help="run a recorded bad step again; --bisect finds the layers to keep "
                       "in float32",
        description="Rebuild the step a flight-recorder bundle holds (its batch, RNG "
                    "states, the model's state, the recorded autocast and loss scale), run "
                    "its forward and backward and say whether it fails again, at which "
                    "layer. --bisect then searches for the smallest set of modules whose "
                    "upcast to float32 makes the step finite and prints the fix as code.")
    parser.add_argument("bundle", nargs="?",
                        help="a .ampbundle file (ampwatch bundles pull RUN STEP); or --run")
    parser.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                        help="a function returning the model (built as in training, "
                             "before loading weights), or (model, loss_fn) where "
                             "loss_fn(output, *args, **kwargs) gives the loss; MODULE is "
                             "an importable name or a .py path")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--bisect", action="store_true",
                        help="search for the modules to keep in float32 and print the fix")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    server = parser.add_argument_group(
        "server", "a bisect of a bundle of a server records its verdict there: the run's "
                  "incident then gives the fix the replay found")
    server.add_argument("--run", metavar="RUN", help="replay the bundle of RUN on the server "
                                                     "(with --step), pulled to a temporary "
                                                     "folder")
    server.add_argument("--step", type=int, metavar="STEP", help="the bundle's step (--run)")
    server.add_argument("--rank", type=int, default=0, help="the bundle's rank (--run)")
    server.add_argument("--server", metavar="URL",
                        help="the server (AMPWATCH_SERVER); a file's verdict is recorded "
                             "only when one is named")
    server.add_argument("--token", default=os.environ.get("AMPWATCH_TOKEN"),
                        help="API token, when the server wants one (AMPWATCH_TOKEN)")
    server.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                        help="per request (default %(default)g)")
    server.add_argument("--no-record", dest="record", action="store_false",
                        help="do not send the bisect verdict to the server")
    parser.set_defaults(func=_replay)


class ModelSpecError(Exception):
    """`--model` names nothing that can be imported and called; the message says why."""


def load_factory(spec: str) -> Any:
    """`module:function` or `path/to/file.py:function` (the current folder is importable).
    Raises ModelSpecError, one line, for a malformed spec, a module that fails to import
    (whatever it raised) or a name it does not have."""
    module_name, _, function = spec.rpartition(":")
    if not module_name or not function:
        raise ModelSpecError(f"--model must be MODULE:FACTORY, got {spec!r}")
    try:
        if module_name.endswith(".py"):
            location = importlib.util.spec_from_file_location(Path(module_name).stem,
                                                              module_name)
            if location is None or location.loader is None:
                raise ImportError(f"{module_name} is not a Python file")
            module = importlib.util.module_from_spec(location)
            location.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything
        raise ModelSpecError(f"cannot import {module_name!r} (--model {spec}): "
                             f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ModelSpecError(f"{module_name!r} has no function {function!r} "
                             f"(--model {spec})")
    return factory


def build(factory: Any) -> tuple[Any, Any]:
    made = factory()
    return (made[0], made[1]) if isinstance(made, tuple) else (made, None)


def _say(line: str) -> None:
    print(printable(line))


def _number(value: Any) -> str:
    return "none" if value is None else (f"{value:.6g}" if math.isfinite(value) else str(value))


def replay_report(bundle_path: str, factory: Any, device: str, bisect: bool) -> dict[str, Any]:
    """What `ampwatch replay` prints, as data."""
    from ampwatch import replay

    bundle = replay.load(bundle_path)
    model, loss_fn = build(factory)
    meta = bundle.meta
    limit = None
    if bundle.trigger == "loss_spike" and meta.get("loss_baseline") is not None:
        limit = abs(meta["loss_baseline"]) * float(meta.get("loss_spike_factor") or 10.0)

    def trial(names: list[str]) -> Any:
        return replay.run_step(model, bundle, loss_fn=loss_fn, device=device,
                               upcast_names=names, loss_limit=limit)

    outcome = trial([])
    report: dict[str, Any] = {
        "run_id": meta.get("run_id"), "rank": int(meta.get("rank") or 0),
        "step": bundle.step, "trigger": bundle.trigger, "exact": bundle.exact,
        "recorded": {"loss": meta.get("loss"),
                     "first_nonfinite_layer": meta.get("first_nonfinite_layer")},
        "replayed": {"loss": outcome.loss, "first_nonfinite_layer": outcome.first_offender,
                     "forward_finite": outcome.forward_finite,
                     "grads_finite": outcome.grads_finite},
        "reproduced": outcome.bad, "unsupported_inputs": bundle.unsupported(),
    }
    if bisect:
        ran_at = datetime.now(UTC).isoformat()
        result = replay.bisect(model, bundle, trial)
        report["bisect"] = {"verdict": str(result.verdict), "modules": result.modules,
                            "fixed": result.fixed, "trials": result.trials,
                            "fp8_modules": result.fp8_modules, "reason": result.reason,
                            "fix": replay.fix_code(result, bundle) if result.fixed else None,
                            "device": device, "ran_at": ran_at}
    return report


def _replay(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("ampwatch replay needs torch: pip install 'ampwatch[agent]'", file=sys.stderr)
        return 2
    if (args.bundle is None) == (args.run is None) or (args.run is None) != (args.step is None):
        raise SystemExit("usage: ampwatch replay BUNDLE --model M:F  |  "
                         "ampwatch replay --run RUN --step STEP [--rank R] --model M:F")
    from ampwatch.replay.bundle import BundleError

    try:
        factory = load_factory(args.model)
    except ModelSpecError as exc:
        print(f"ampwatch replay: {printable(str(exc))}", file=sys.stderr)
        return 2
    try:
        return _replay_bundle(args, factory)
    except BundleError as exc:
        raise SystemExit(f"ampwatch replay: {printable(exc)}") from exc
    except pickle.UnpicklingError as exc:  # weights_only refused what is not plain tensors
        raise SystemExit("ampwatch replay: the bundle's state.pt holds more than tensors "
                         "(refused unread: it could run code)") from exc


def _replay_bundle(args: argparse.Namespace, factory: Any) -> int:
    if args.run is None:
        report = replay_report(args.bundle, factory, args.device, args.bisect)
        origin = origin_of(report, args.server, args.token)
    else:
        origin = BundleOrigin(args.server, args.token, args.run, args.rank, args.step)
        with tempfile.TemporaryDirectory(prefix="ampwatch-replay-") as folder:
            path = pull(origin, Path(folder), args.timeout)
            report = replay_report(str(path), factory, args.device, args.bisect)
    if "bisect" in report and origin is not None and args.record:
        unrecorded = record_verdict(origin, report["bisect"], args.timeout)
        report["bisect"]["recorded"] = unrecorded is None
    if args.json:
        print(json.dumps(report, default=str))
        return 0 if report["reproduced"] else 1
    recorded, replayed = report["recorded"], report["replayed"]

    _say(f"bundle: step {report['step']}, trigger {report['trigger']}; parameters "
        f"{'exact' if report['exact'] else 'APPROXIMATE (taken after the step)'}")
    _say(f"recorded: loss {_number(recorded['loss'])}, first non-finite layer "
        f"{recorded['first_nonfinite_layer'] or 'none'}")
    _say(f"replayed on {args.device}: loss {_number(replayed['loss'])}, first non-finite "
        f"layer {replayed['first_nonfinite_layer'] or 'none'}, grads finite "
        f"{replayed['grads_finite'] if replayed['grads_finite'] is not None else 'n/a'}")
    _say(f"reproduced: {'yes' if report['reproduced'] else 'no'}")
    for value in report["unsupported_inputs"]:
        _say(f"note: an input was not data and could not be kept: {value}")
    if "bisect" in report:
        result = report["bisect"]
        if result["fixed"]:
            _say(f"bisect: keeping {', '.join(result['modules'])} in float32 makes the step "
                f"finite ({result['trials']} trials). Fix:")
            print()
            print(printable(result["fix"], lines=True))
        else:
            _say(f"bisect: {result['reason']} ({result['trials']} trials)")
        if result.get("recorded"):
            _say(f"verdict recorded on the server with the bundle (run {origin.run_id}, "
                f"rank {origin.rank}, step {origin.step})")
    return 0 if report["reproduced"] else 1
