"""The ``air`` command: look at a checkpoint root from a shell.

    air ls ROOT                      every checkpoint: step, time, size, status (committed/partial/corrupt)
                                     and the file or folder it holds (Lightning's epoch=0-step=10.ckpt)
    air verify ROOT [NAME ...]       re-read committed checkpoints and check sizes and CRC-32 checksums;
                                     NAME is a checkpoint's name or the file or folder it holds
    air report ROOT [--plot F.png]   checkpoint latencies, fetch_seconds, stragglers, goodput, bytes
                                     moved and work repeated of every launch; --json for one object,
                                     --gpu-hour-price etc. for cost lines
    air preflight [ROOT] [--json F]  check this node (storage, staging disk, memory, GPUs; under
                                     torchrun also links and clocks between ranks) before a job

ROOT is any fsspec URL or path; ``--storage-options '{"client_kwargs": {...}}'``, before or after the
command, passes options to fsspec (credentials are better left to the environment). Exit status: 0 fine,
1 a checkpoint failed verification, 2 bad usage or a root that cannot be read or is not there. "Not
there" is what the filesystem can tell: a local folder that does not exist, or a bucket (container) the
object store says does not exist; a prefix with nothing under it cannot be told from an empty root, so
it is one (exit 0).
``air preflight``: 0 ok, 1 warn, 2 bad node (do not reschedule the job here), 64 bad usage;
``torchrun --nproc-per-node N -m air_core.cli preflight ROOT`` checks the links and clocks between
ranks too. A command whose output's reader goes away (``air report ROOT | head -1``) stops quietly
with 141 (128 + SIGPIPE, as a tool that signal ends).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .catalog import scan
from .errors import AirError, ConfigError, CorruptCheckpointError
from .manifest import CheckpointInfo
from .recovery import fetch
from .session.accounting import Prices, account, human_bytes, lines
from .session.goodput import analyze, read_events
from .session.paths import entry_of_commit
from .session.report import measure_lines, measures, plot, plot_problem
from .storage import Storage


def _when(info: CheckpointInfo) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.time)) if info.time else "-"


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    infos = scan(storage)
    if not infos:
        print(f"no checkpoints under {storage.display()}")
        return 0
    print(f"{'name':32} {'step':>9} {'time':19} {'size':>10}  {'holds':24}  status")
    for i in infos:
        status = i.status if i.status == "committed" else f"{i.status}: {i.reason}"
        size = human_bytes(i.total_bytes)
        print(f"{i.name:32} {i.step:9d} {_when(i):19} {size:>10}  {_holds(i):24}  {status}")
    return 0


def _holds(info: CheckpointInfo) -> str:
    """The file or folder under the root a commit holds (the name the framework gave it), else ``-``."""
    return entry_of_commit(info) if info.manifest is not None else "-"


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    infos = {i.name: i for i in scan(storage)}
    # a checkpoint the listing already finds corrupt (a file missing or cut short) failed verification too;
    # a partial one never committed, so there is nothing to verify
    held = [i for i in infos.values() if i.status in ("committed", "corrupt")]
    by_entry = {_holds(i): i.name for i in held}  # a file or folder saved again: its newest commit
    names = [n if n in infos else by_entry.get(n, n) for n in args.names] or [i.name for i in held]
    if not names:  # silence with exit 0 would read as "all verified"
        others = f" ({len(infos)} partial: air ls says why)" if infos else ""
        print(f"nothing committed under {storage.display()}{others}")
        return 0
    unknown = [n for n in names if n not in infos]
    if unknown:
        print(
            f"air verify: no checkpoint named {', '.join(unknown)} under {storage.display()}", file=sys.stderr
        )
        return 2
    failed = 0
    for name in names:
        problem = _verify_one(storage, infos[name])
        failed += bool(problem)
        holds = _holds(infos[name])
        label = name if holds in ("-", name) else f"{holds} ({name})"
        print(f"{label}: {'OK' if not problem else 'FAILED: ' + problem}")
    return 1 if failed else 0


def _verify_one(storage: Storage, info: CheckpointInfo) -> str:
    """Re-read every file through ``recovery.fetch`` (remote ones into a temp folder), with progress."""
    if info.manifest is None or info.status == "corrupt":
        return info.reason or info.status
    import tempfile

    files = info.manifest.files
    total = sum(f.size for f in files) or 1
    done = 0
    with tempfile.TemporaryDirectory(prefix="air-verify-") as tmp:
        for k, entry in enumerate(files, 1):
            try:
                fetch(storage, None if storage.is_local else tmp, info.manifest, [entry], max_transfers=1)
            except CorruptCheckpointError as exc:
                print(file=sys.stderr)
                return str(exc)
            except FileNotFoundError:
                print(file=sys.stderr)
                return f"{entry.path} is missing"
            done += entry.size
            print(f"\r  {info.name}: {k}/{len(files)} files, {done / total:.0%}", end="", file=sys.stderr)
    print(file=sys.stderr)
    return ""


def cmd_report(storage: Storage, args: argparse.Namespace) -> int:
    problem = plot_problem(args.plot) if args.plot else None
    if problem:  # found before the report: it failed after printing all of it
        print(f"air report: {problem}", file=sys.stderr)
        return 2
    launches = read_events(storage)
    prices = Prices(args.gpu_hour_price, args.storage_gb_month_price, args.egress_gb_price)
    result = analyze(launches)
    accounting = account(launches, sum(storage.sizes().values()), prices)
    measured = measures(launches)
    if args.json:
        print(json.dumps({"goodput": result.as_metrics(), **accounting, **measured}))
        return 0
    if not launches:
        print(
            f"no goodput events under {storage.display()} (written by the Lightning, Accelerate and "
            "transformers adapters)"
        )
        return 0
    print("\n".join(measure_lines(measured)))
    print(result.report())
    print("\n".join(lines(accounting)))
    if args.plot:
        plot(args.plot, launches, result)
        print(f"plot: {args.plot}")
    return 0


def _price(text: str) -> float:
    """A price a cost line can use: ``float`` also takes ``nan`` and ``inf``, which would print as costs."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a price: pass a number >= 0, e.g. 2.5")
    return value


def _bytes(text: str) -> int:
    """A size in bytes for ``air preflight``: ``int`` also takes ``-5``, which the checks judged as -0 MiB."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: pass a whole number of bytes >= 0, e.g. 4000000000"
        )
    return value


def _timeout(text: str) -> float:
    """The storage check's bound: 0 or less would judge the node bad, ``inf`` would not bound it."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a timeout: pass seconds > 0, e.g. 30")
    return value


USAGE = 64
"""``air preflight``'s exit status for bad usage (``EX_USAGE``): its 2 means a bad node."""


def _usage_error(parser: argparse.ArgumentParser) -> Any:
    def error(message: str) -> NoReturn:
        parser.print_usage(sys.stderr)
        parser.exit(USAGE, f"{parser.prog}: error: {message}\n")

    return error


def cmd_preflight(args: argparse.Namespace, storage_options: dict[str, Any]) -> int:
    """Every check on this node; under ``torchrun`` (``WORLD_SIZE`` > 1) on every rank, with the checks
    between them. Rank 0 prints one line per check and writes ``--json``."""
    from .health.preflight import parse_checks, run_preflight

    try:
        selected = args.checks.split(",") if args.checks else True
        checks = parse_checks(selected, setting="air preflight --checks")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return USAGE
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1:
        import torch
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        report = run_preflight(
            checks,
            root=args.root,
            storage_options=storage_options,
            staging_dir=args.staging_dir,
            host_budget_bytes=args.host_budget_bytes,
            expected_bytes=args.expected_bytes,
            rank=rank,
            world_size=world_size,
            storage_timeout_seconds=args.timeout,
        )
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    if rank == 0:
        print("\n".join(report.lines()))
        print(f"preflight: {report.status} ({report.seconds:.2f} s, {world_size} rank(s))")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report.as_dict(), f, indent=1)
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)  # before or after the subcommand
    # SUPPRESS: a subcommand's default would overwrite the value given before it.
    common.add_argument("--storage-options", default=argparse.SUPPRESS, help="JSON object passed to fsspec")
    p = argparse.ArgumentParser(
        prog="air",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", parents=[common], help="list checkpoints with step, time, size and status")
    ls.add_argument("root")
    verify = sub.add_parser("verify", parents=[common], help="re-check sizes and checksums")
    verify.add_argument("root")
    verify.add_argument(
        "names",
        nargs="*",
        help="checkpoints, or files or folders they hold, to verify (default: every committed one)",
    )
    report = sub.add_parser("report", parents=[common], help="latency, fetch and goodput summary")
    report.add_argument("root")
    report.add_argument("--plot", default=None, help="also draw it to this PNG file")
    report.add_argument(
        "--json",
        action="store_true",
        help="print all of it as one JSON object (latencies, fetch, restores, goodput, bytes, work, cost)",
    )
    for flag, what in (
        ("--gpu-hour-price", "price of one GPU (rank) for an hour: cost lines for lost GPU time"),
        ("--storage-gb-month-price", "price of storing a GB (10^9 bytes) for a month"),
        ("--egress-gb-price", "price of downloading a GB from the root"),
    ):
        report.add_argument(flag, type=_price, default=None, help=what)
    pre = sub.add_parser(
        "preflight", parents=[common], help="check this node before a job (exit 0 ok, 1 warn, 2 bad node)"
    )
    pre.add_argument("root", nargs="?", default=None, help="checkpoint root to put a canary object under")
    pre.add_argument("--staging-dir", default=None, help="local staging folder (default: the temp folder)")
    pre.add_argument("--expected-bytes", type=_bytes, default=None, help="one rank's checkpoint size, bytes")
    pre.add_argument("--host-budget-bytes", type=_bytes, default=None, help="the job's host_budget_bytes")
    pre.add_argument("--checks", default="", help="comma-separated subset (default: all)")
    pre.add_argument("--timeout", type=_timeout, default=30.0, help="storage check timeout, seconds")
    pre.add_argument("--json", default=None, help="write the report as JSON to this file (rank 0)")
    pre.error = _usage_error(pre)  # type: ignore[method-assign]  # 2 means "bad node" here
    args, extra = p.parse_known_args(argv)
    usage = pre if args.command == "preflight" else p  # the top parser would exit 2 for preflight's
    if extra:
        usage.error(f"unrecognized arguments: {' '.join(extra)}")
    text = getattr(args, "storage_options", "{}")
    try:
        options = json.loads(text)
    except ValueError as exc:
        usage.error(f"--storage-options is not JSON ({exc}); pass an object, e.g. '{{\"anon\": true}}'")
    if not isinstance(options, dict):
        usage.error(
            f"--storage-options {text} is not a JSON object (fsspec takes keyword "
            "options); pass an object, e.g. '{\"anon\": true}'"
        )
    try:
        code = _dispatch(args, options)
        sys.stdout.flush()  # output to a pipe is buffered: a reader gone shows here, else at exit
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (AirError, OSError, ValueError) as exc:
        print(f"air {args.command}: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, options: dict[str, Any]) -> int:
    if args.command == "preflight":
        return cmd_preflight(args, options)
    storage = Storage(args.root, storage_options=options, retries=3, retry_backoff_seconds=0.2)
    # an endpoint down or wrong: said in seconds, not after every retry
    Storage.probe(args.root, storage_options=options, beside=storage).check_reachable()
    missing = storage.missing()
    if missing:  # a typo in ROOT would otherwise read as an empty root: exit 0, nothing found
        print(f"air {args.command}: {missing}; ROOT is the folder or URL a job saved to", file=sys.stderr)
        return 2
    command = {"ls": cmd_ls, "verify": cmd_verify, "report": cmd_report}[args.command]
    return command(storage, args)


PIPE_CLOSED = 141
"""The exit status when stdout's reader went away (``air report ROOT | head -1``): 128 + SIGPIPE, what
a shell shows for a tool that signal ended."""


def _stdout_closed() -> int:
    """Stop quietly, as a tool that SIGPIPE ends does. Python ignores SIGPIPE (a socket's reset must not
    end the process), so the write raised instead; stdout goes to devnull so that the flush at exit
    does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
