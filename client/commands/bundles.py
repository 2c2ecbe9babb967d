"""`ampwatch bundles RUN` and `ampwatch bundles pull RUN STEP`: the flight recorder's bad
steps on the server, and one brought to this machine for `ampwatch replay`."""

from __future__ import annotations

import argparse

from ampwatch.client.commands import connect, print_json
from ampwatch.wire.bundles import MODEL_FACTORY_UNKNOWN, replay_command


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    bundles = commands.add_parser(
        "bundles", parents=[common], help="a run's recorded bad steps (ampwatch replay)",
        description="List the flight-recorder bundles of RUN (step, rank, trigger, first "
                    "non-finite layer, size), or with `pull RUN STEP` download one.")
    bundles.add_argument("run", metavar="RUN",
                         help="run id (or `pull`, then RUN STEP: download one bundle)")
    bundles.add_argument("step", metavar="STEP", nargs="*", help=argparse.SUPPRESS)
    bundles.add_argument("--rank", type=int, default=0, help="rank of the bundle to pull")
    bundles.add_argument("-o", "--output", default=".", metavar="PATH",
                         help="file or folder to save a pulled bundle in (default: here)")
    bundles.set_defaults(func=run_bundles)


def run_bundles(args: argparse.Namespace) -> int:
    # `pull` is a word, not a subcommand: `ampwatch bundles RUN` must stay one positional
    if args.run == "pull":
        if len(args.step) != 2 or not args.step[1].isdigit():
            raise SystemExit("usage: ampwatch bundles pull RUN STEP [--rank N] [-o PATH]")
        run_id, step = args.step[0], int(args.step[1])
        with connect(args) as client:
            path = client.download_bundle(run_id, step, args.output, rank=args.rank)
            factory = next((b.model_factory for b in client.bundles(run_id)
                            if (b.step, b.rank) == (step, args.rank)), None)
            server = client.base_url
        if args.json:
            print_json({"path": str(path)})
        else:
            # --server: the bisect's verdict goes back with the bundle (docs/replay.md)
            print(f"{path}\nreplay it: "
                  f"{replay_command(factory, path=str(path), server=server)}")
            if factory is None:
                print(MODEL_FACTORY_UNKNOWN)
        return 0
    if args.step:
        raise SystemExit("usage: ampwatch bundles RUN  |  ampwatch bundles pull RUN STEP")
    with connect(args) as client:
        found = client.bundles(args.run)
    if args.json:
        print_json(list(found))
        return 0
    if not found:
        print(f"run {args.run} has no bundles")
        return 0
    print(f"{'step':>10} {'rank':>4}  {'trigger':<18} {'first non-finite layer':<28} "
          f"{'exact':<5} {'bytes':>12}")
    for b in found:
        print(f"{b.step:>10} {b.rank:>4}  {b.trigger:<18} "
              f"{(b.first_nonfinite_layer or '-'):<28} {'yes' if b.exact else 'no':<5} "
              f"{b.bytes:>12}")
    print(f"\npull one: ampwatch bundles pull {args.run} STEP")
    return 0
