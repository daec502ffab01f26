"""Run the frameworks' own checkpoint tests stock and with air-plugins substituted; compare per test.

    python -m compat.run                        # Lightning (io and callback), Accelerate, transformers
    python -m compat.run --framework lightning --mode io -k checkpoint
    python -m compat.run tests_pytorch/models/test_restore.py --json out.json
    python -m compat.run --framework transformers -k resume

Each pytest run works on its own copy of the test tree in a temporary folder (the tests write beside
themselves). Our classes are substituted by the pytest plugins ``compat.substitute_lightning``,
``compat.substitute_accelerate`` and ``compat.substitute_transformers``; outcomes are collected by
``compat.outcomes``. Tests that pass stock and not with the substitution are regressions, unless
``docs/compat.md`` lists them as exceptions. With ``--jobs`` above 1 the workers of a run share its
copy of the tree, and a test that checks its folders (Lightning's "Test left artifacts behind") can see
another worker's files (stock Lightning's own loggers make ``memory:/`` folders in the working
directory): each regression is run again alone, and one that passes then is reported apart, as a race
between workers, not counted.
Exit status: 0 without regressions, 1 with, 2 when a run could not be made.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import glob
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCEPTIONS_DOC = os.path.join(REPO, "docs", "compat.md")
CACHE = os.path.join(REPO, ".compat-cache")

LIGHTNING_FILES = [  # relative to Lightning's tests/ folder (shared/compat/README.md)
    "tests_pytorch/checkpointing",
    "tests_pytorch/plugins/test_checkpoint_io_plugin.py",
    "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    "tests_pytorch/models/test_restore.py",
    "tests_pytorch/callbacks/test_model_checkpoint*.py",
    "tests_pytorch/trainer/test_trainer.py",
    "tests_pytorch/loops/test_loops.py",
    "tests_pytorch/core/test_saving.py",
    "tests_pytorch/core/test_datamodules.py",
    "tests_pytorch/models/test_hparams.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/models/test_cpu.py",
    "tests_pytorch/callbacks/test_callbacks.py",
    "tests_pytorch/callbacks/test_timer.py",
    "tests_pytorch/callbacks/test_finetuning_callback.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/trainer/connectors/test_signal_connector.py",
]
# It reads the old releases' checkpoints that Lightning's CI downloads into tests/legacy/ (not in the tree).
LIGHTNING_IGNORE = ["tests_pytorch/checkpointing/test_legacy_checkpoints.py"]
ACCELERATE_FILES = ["tests/test_state_checkpointing.py", "tests/test_accelerator.py"]
# transformers keeps its Trainer checkpoint tests (save intervals, resume, rotation and save_total_limit,
# best model, JIT checkpoints, the saved processor files) in one file since the test suite was split.
TRANSFORMERS_FILES = ["tests/trainer/test_trainer_checkpointing.py"]
PASSING = ("passed", "xfailed")  # an expected failure that still fails is as good as a pass


@dataclass
class Framework:
    name: str
    src: str  # folder to copy; pytest runs inside the copy
    copy: list[str]  # entries of src to copy
    workdir: str  # relative to the copy: where pytest runs
    files: list[str]  # selection, relative to workdir
    plugin: str
    ignore: list[str] = field(default_factory=list)  # files that cannot run here, relative to workdir
    modes: list[str | None] = field(default_factory=lambda: [None])
    env: dict[str, str] = field(default_factory=dict)  # set for its pytest runs unless already set


# -- locating the test trees --------------------------------------------------------------------
def lightning_tree(path: str | None) -> str:
    path = (
        path
        or os.environ.get("AIR_COMPAT_LIGHTNING")
        or os.path.join(REPO, "..", "shared", "compat", "lightning-2.6.5")
    )
    path = os.path.abspath(path)
    if os.path.basename(path) == "tests" and os.path.isdir(os.path.join(path, "tests_pytorch")):
        path = os.path.dirname(path)
    if not os.path.isdir(os.path.join(path, "tests", "tests_pytorch")):
        raise SystemExit(
            f"compat: no Lightning test tree at {path} (expected tests/tests_pytorch/ there); pass "
            "--lightning-tests or set AIR_COMPAT_LIGHTNING to the checkout holding Lightning's tests/."
        )
    return path


def accelerate_tree(path: str | None) -> str:
    path = path or os.environ.get("AIR_COMPAT_ACCELERATE")
    if path:
        path = os.path.abspath(path)
        if os.path.basename(path) == "tests":
            path = os.path.dirname(path)
        if not os.path.isfile(os.path.join(path, "tests", "test_state_checkpointing.py")):
            raise SystemExit(f"compat: no Accelerate tests/ folder under {path}.")
        return path
    version = importlib.metadata.version("accelerate")
    unpacked = os.path.join(CACHE, f"accelerate-{version}")
    if not os.path.isdir(os.path.join(unpacked, "tests")):
        unpack_sdist("accelerate", version)
    return unpacked


def unpack_sdist(package: str, version: str) -> None:
    """Download ``package``'s source distribution at ``version`` into ``.compat-cache/`` (once) and
    unpack it there (``<package>-<version>/``)."""
    os.makedirs(CACHE, exist_ok=True)
    archive = os.path.join(CACHE, f"{package}-{version}.tar.gz")
    if not os.path.isfile(archive):
        print(f"compat: downloading the {package} {version} source distribution (its tests) into {CACHE}")
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*command, f"{package}=={version}", "-d", CACHE], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")


TRANSFORMERS_MARKER = os.path.join("tests", "trainer", "test_trainer_checkpointing.py")


def transformers_tree(path: str | None) -> str:
    """A transformers source tree holding ``tests/trainer/`` at the installed version.

    ``--transformers-tests`` or ``$AIR_COMPAT_TRANSFORMERS``; else ``../shared/compat/transformers-<v>``
    (a checkout kept beside the repository, as Lightning's is); else ``.compat-cache/transformers-<v>``,
    the installed version's source distribution unpacked there. The sdist ships only the top-level
    ``tests/*.py`` (5.24.0 does), so ``tests/trainer/`` has to be put into that folder (or one of the
    others) from the repository's tag ``v<version>``; the run says so and stops if it is missing."""
    version = importlib.metadata.version("transformers")
    path = path or os.environ.get("AIR_COMPAT_TRANSFORMERS")
    if path:
        path = os.path.abspath(path)
        if os.path.basename(path) == "tests":
            path = os.path.dirname(path)
        if not os.path.isfile(os.path.join(path, TRANSFORMERS_MARKER)):
            raise SystemExit(f"compat: no transformers {TRANSFORMERS_MARKER} under {path}.")
        return path
    shared = os.path.abspath(os.path.join(REPO, "..", "shared", "compat", f"transformers-{version}"))
    if os.path.isfile(os.path.join(shared, TRANSFORMERS_MARKER)):
        return shared
    unpacked = os.path.join(CACHE, f"transformers-{version}")
    if not os.path.isdir(os.path.join(unpacked, "tests")):
        unpack_sdist("transformers", version)
    if not os.path.isfile(os.path.join(unpacked, TRANSFORMERS_MARKER)):
        raise SystemExit(
            f"compat: the transformers {version} source distribution has no tests/trainer/. Put the "
            f"repository's tests/trainer/ at tag v{version} (with tests/__init__.py) into {unpacked} or "
            f"{shared}, or pass --transformers-tests PATH (or set AIR_COMPAT_TRANSFORMERS) to a checkout."
        )
    return unpacked


# -- our code, frozen for the whole run ---------------------------------------------------------
OURS = ["air_core", "lightning_air", "accelerate_air", "transformers_air"]
PACKAGES = [*OURS, "compat"]


def snapshot_code(rev: str, dest: str) -> str:
    """Copy our packages (the working tree's, or those of commit ``rev``) to ``dest``, which every pytest
    run puts first on ``sys.path``: edits made while the run goes on do not mix into it."""
    os.makedirs(dest)

    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if rev == "worktree":
        for package in PACKAGES:
            shutil.copytree(
                os.path.join(REPO, package),
                os.path.join(dest, package),
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        # "XY path" lines; git() strips the first line's leading blank (" M"), so split off the path
        status = git("status", "--porcelain", "--", *OURS).splitlines()
        dirty = [line.split(maxsplit=1)[-1] for line in status]
        return f"working tree at {head}" + (
            f" with uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)"
        )
    commit = git("rev-parse", "--short=12", rev)
    if not commit:
        raise SystemExit(f"compat: --code {rev}: not a commit of {REPO}")
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", commit, *OURS], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    shutil.copytree(
        os.path.join(REPO, "compat"),
        os.path.join(dest, "compat"),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return f"commit {commit} ({rev})"


# -- documented exceptions ----------------------------------------------------------------------
def read_exceptions(path: str = EXCEPTIONS_DOC) -> dict[str, str]:
    """``test id -> reason`` from the table under the "Exceptions" heading of docs/compat.md."""
    if not os.path.isfile(path):
        return {}
    exceptions: dict[str, str] = {}
    in_section = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("#"):
            in_section = line.lstrip("#").strip().lower().startswith("exceptions")
            continue
        if not in_section or not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0].lower() in ("test id", "test"):
            continue
        exceptions[cells[0].strip("`")] = cells[1]
    return exceptions


def excepted(nodeid: str, exceptions: dict[str, str]) -> str | None:
    """The reason if ``nodeid`` is listed (exactly, without its parameters, or as a glob pattern).
    Lightning's ids are listed relative to its ``tests/`` folder, where the run prints ``tests/...``."""
    for pattern, reason in exceptions.items():
        for test in {nodeid, nodeid.removeprefix("tests/")}:
            if test == pattern or test.split("[", 1)[0] == pattern or fnmatch.fnmatchcase(test, pattern):
                return reason
    return None


# -- running pytest -----------------------------------------------------------------------------
def run_pytest(
    fw: Framework,
    mode: str | None,
    substitute: bool,
    tmp: str,
    args: argparse.Namespace,
    log_dir: str | None,
    suffix: str = "",
) -> dict[str, dict[str, Any]]:
    label = f"{fw.name}-{'stock' if not substitute else mode or 'ours'}{suffix}"
    copy = os.path.join(tmp, label)
    os.makedirs(copy)
    for entry in fw.copy:
        src = os.path.join(fw.src, entry)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(copy, entry), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, os.path.join(copy, entry))
    workdir = os.path.join(copy, fw.workdir)
    files = []
    for pattern in fw.files:  # globs (test_model_checkpoint*.py) expanded here; node ids kept as given
        if "::" not in pattern and any(c in pattern for c in "*?"):
            files += sorted(os.path.relpath(m, workdir) for m in glob.glob(os.path.join(workdir, pattern)))
        else:
            files.append(pattern)
    outcomes = os.path.join(tmp, f"{label}.jsonl")
    plugins = ["-p", "compat.outcomes"] + (["-p", fw.plugin] if substitute else [])
    hidden_log = os.path.join(tmp, f"{label}.hidden")
    if substitute and args.hide_metadata:
        plugins += ["-p", "compat.hide_metadata"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *plugins,
        "-p",
        "no:cacheprovider",
        "--color=no",
        "-q",
        "-rN",
        f"--timeout={args.timeout}",
        "--basetemp",
        os.path.join(tmp, f"{label}-pytest-tmp"),
    ]
    cmd += ["--continue-on-collection-errors", *(f"--ignore={path}" for path in fw.ignore)]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs), "--dist", "loadfile"]
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args + files
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.join(tmp, "_plugins"), env.get("PYTHONPATH")] if p
    )
    for key, value in fw.env.items():
        env.setdefault(key, value)
    env["AIR_COMPAT_OUTCOMES"] = outcomes
    env["AIR_COMPAT_HIDDEN_LOG"] = hidden_log
    env.pop("AIR_COMPAT_MODE", None)
    if mode:
        env["AIR_COMPAT_MODE"] = mode
    log = os.path.join(log_dir or tmp, f"{label}.log")
    print(f"compat: {label}: pytest {' '.join(cmd[3:])}\n        in {workdir}, log {log}", flush=True)
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        # Its own process group: the processes tests fork (loader workers) are ended with it.
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM if proc.returncode is None else signal.SIGKILL)
            proc.wait()
    results: dict[str, dict[str, Any]] = {}
    if os.path.isfile(outcomes):
        for line in open(outcomes, encoding="utf-8"):
            rec = json.loads(line)
            results[rec["nodeid"]] = rec
    if os.path.isfile(hidden_log):  # tests from whose listings compat.hide_metadata removed .air/
        for line in open(hidden_log, encoding="utf-8"):
            if line.strip() in results:
                results[line.strip()]["metadata_hidden"] = True
    lines = open(log, encoding="utf-8", errors="replace").read().splitlines()
    summary = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
    tail = [line.strip("= ") for line in reversed(lines) if summary.search(line)][:1] or [""]
    print(
        f"compat: {label}: {len(results)} tests in {time.monotonic() - started:.0f} s, pytest exit {rc}: "
        f"{tail[0]}",
        flush=True,
    )
    if not results or rc not in (0, 1):  # 2 interrupted, 3 internal error, 4 usage, 5 nothing collected
        raise SystemExit(f"compat: {label}: pytest did not complete (exit {rc}); see {log}")
    shutil.rmtree(copy, ignore_errors=True)  # tests' own files; keep the disk small
    return results


def stock_from(path: str, framework: str) -> dict[str, dict[str, Any]] | None:
    """The stock outcomes of ``framework`` in an earlier ``--json`` report (None if it has none)."""
    for run in json.load(open(path, encoding="utf-8"))["runs"]:
        if run["framework"] == framework:
            print(f"compat: {framework}-stock: outcomes from {path} ({len(run['stock'])} tests)", flush=True)
            return {t: {"nodeid": t, "outcome": o, "message": ""} for t, o in run["stock"].items()}
    return None


# -- comparing ----------------------------------------------------------------------------------
def first_line(text: str, width: int = 160) -> str:
    line = next((s.strip() for s in (text or "").splitlines() if s.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def compare(
    stock: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]], exceptions: dict[str, str]
) -> dict[str, Any]:
    rows, regressions, documented, fixed = [], [], [], []
    stock_pass = [t for t, r in stock.items() if r["outcome"] in PASSING]
    ours_pass = [t for t in stock_pass if ours.get(t, {}).get("outcome") in PASSING]
    # --hide-metadata: passing only because a listing did not show .air/ is not a plain pass
    hidden = [t for t in ours_pass if ours[t].get("metadata_hidden")]
    for nodeid in sorted(set(stock) | set(ours)):
        s = stock.get(nodeid, {}).get("outcome", "missing")
        o = ours.get(nodeid, {}).get("outcome", "missing")
        if s == o or (s in PASSING and o in PASSING):
            continue
        rec = ours.get(nodeid) or {}
        row = {"nodeid": nodeid, "stock": s, "ours": o, "message": first_line(rec.get("message", ""))}
        if s in PASSING:
            reason = excepted(nodeid, exceptions)
            row["exception"] = reason
            (documented if reason else regressions).append(nodeid)
        elif o in PASSING:
            fixed.append(nodeid)
        rows.append(row)
    return {
        "counts": {
            "tests": len(stock),
            "stock_pass": len(stock_pass),
            "ours_pass_of_stock_pass": len(ours_pass),
            "regressions": len(regressions),
            "documented_exceptions": len(documented),
            "ours_pass_stock_not": len(fixed),
            "ours_pass_with_metadata_hidden": len(hidden),
        },
        "rows": rows,
        "regressions": regressions,
        "documented": documented,
        "metadata_hidden": hidden,
    }


def rerun_alone(
    fw: Framework, mode: str | None, result: dict[str, Any], tmp: str, args: argparse.Namespace
) -> dict[str, Any]:
    """``result`` with its regressions run again, alone (one worker): those that pass then move to
    ``"parallel_only"`` (a race between workers sharing a tree), out of the regressions' count."""
    if not result["regressions"] or args.jobs == 1:
        return {**result, "parallel_only": []}
    prefix = fw.workdir.rstrip("/") + "/" if fw.workdir not in ("", ".") else ""
    picked = [t.removeprefix(prefix) for t in result["regressions"]]
    serial = argparse.Namespace(**{**vars(args), "jobs": 1, "k": None})
    alone = run_pytest(replace(fw, files=picked), mode, True, tmp, serial, args.log_dir, "-alone")
    passed = [t for t in result["regressions"] if alone.get(t, {}).get("outcome") in PASSING]
    for row in result["rows"]:
        if row["nodeid"] in passed:
            row["parallel_only"] = True
    regressions = [t for t in result["regressions"] if t not in passed]
    counts = {**result["counts"], "regressions": len(regressions), "parallel_only": len(passed)}
    return {**result, "counts": counts, "regressions": regressions, "parallel_only": passed}


def print_report(label: str, result: dict[str, Any]) -> None:
    rows = result["rows"]
    print(f"\n=== {label}: tests whose outcome differs (stock -> ours) ===")
    if not rows:
        print("(none)")
    for row in rows:
        note = " [documented exception]" if row.get("exception") else ""
        note += " [passed when run again alone: a race between workers]" if row.get("parallel_only") else ""
        print(f"{row['stock']:>8} -> {row['ours']:<8} {row['nodeid']}{note}")
        if row["message"] and row["ours"] not in PASSING:
            print(f"{'':20}{row['message']}")
    c = result["counts"]
    print(
        f"--- {label}: {c['tests']} tests; stock pass {c['stock_pass']}; ours pass among those "
        f"{c['ours_pass_of_stock_pass']}; regressions {c['regressions']}; documented exceptions "
        f"{c['documented_exceptions']}; ours pass where stock does not {c['ours_pass_stock_not']}"
        + (f"; passed when run again alone {c['parallel_only']}" if c.get("parallel_only") else "")
        + (
            f"; of ours passing, {c['ours_pass_with_metadata_hidden']} with .air/ hidden from a listing"
            if result["metadata_hidden"]
            else ""
        ),
        flush=True,
    )


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m compat.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=["lightning", "accelerate", "transformers", "all"], default="all")
    p.add_argument(
        "--mode",
        choices=["io", "callback", "both"],
        default="both",
        help="Lightning: io = AirCheckpointIO on every Trainer; callback = also AirCallback",
    )
    p.add_argument(
        "--lightning-tests",
        metavar="PATH",
        help="checkout holding Lightning's tests/ "
        "(default: $AIR_COMPAT_LIGHTNING or ../shared/compat/lightning-2.6.5)",
    )
    p.add_argument(
        "--accelerate-tests",
        metavar="PATH",
        help="Accelerate source tree holding tests/ "
        "(default: $AIR_COMPAT_ACCELERATE or the installed version's sdist, in .compat-cache/)",
    )
    p.add_argument(
        "--transformers-tests",
        metavar="PATH",
        help="transformers source tree holding tests/trainer/ (default: $AIR_COMPAT_TRANSFORMERS, "
        "../shared/compat/transformers-<version>, or .compat-cache/transformers-<version>/)",
    )
    p.add_argument("-k", metavar="EXPR", help="passed to pytest -k")
    p.add_argument(
        "selection",
        nargs="*",
        help="test files or node ids instead of the default lists: tests_pytorch/... for Lightning, "
        "tests/trainer/... for transformers, other tests/... for Accelerate",
    )
    p.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run (default 1: serial)")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds (pytest-timeout)")
    p.add_argument("--json", metavar="PATH", help="write counts, differing tests and messages as JSON")
    p.add_argument("--log-dir", metavar="DIR", help="keep each pytest run's full output there")
    p.add_argument(
        "--code",
        default="worktree",
        metavar="REV",
        help="our packages to test: 'worktree' "
        "(default: as they are now, copied at the start) or a git commit such as HEAD",
    )
    p.add_argument(
        "--hide-metadata",
        action="store_true",
        help="substituted runs hide .air/ and "
        ".air-events/ from the listings tests and frameworks make (compat.hide_metadata); such "
        "passes are counted apart",
    )
    p.add_argument(
        "--stock-from",
        metavar="JSON",
        help="take the stock outcomes from an earlier --json "
        "of the same selection instead of running stock again",
    )
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    args = p.parse_args(argv)
    args.pytest_args = args.pytest_args.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C: the running pytest's process group ends, the temporary folder goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.jobs > 1:
        try:
            import xdist  # noqa: F401
        except ImportError:
            print("compat: pytest-xdist is not installed; running serially")
            args.jobs = 1
    for module in ("pytest_timeout", "tensorboardX", "parameterized"):
        try:
            __import__(module)
        except ImportError:
            print(f"compat: {module} is missing: pip install pytest-timeout tensorboardX parameterized")
            return 2
    frameworks: list[Framework] = []
    # Lightning's node ids print as tests/tests_pytorch/... (its rootdir holds tests/): accept them too
    args.selection = [
        s.removeprefix("tests/") if s.startswith("tests/tests_pytorch") else s for s in args.selection
    ]
    picked_l = [s for s in args.selection if s.startswith("tests_pytorch")]
    picked_t = [s for s in args.selection if s.startswith("tests/trainer/")]
    picked_a = [s for s in args.selection if s.startswith("tests/") and s not in picked_t]
    if args.selection and len(picked_l) + len(picked_a) + len(picked_t) != len(args.selection):
        print(
            "compat: a selection starts with tests_pytorch/ (Lightning), tests/trainer/ (transformers) "
            "or tests/ (Accelerate)"
        )
        return 2
    if args.framework in ("lightning", "all") and (picked_l or not args.selection):
        frameworks.append(
            Framework(
                "lightning",
                lightning_tree(args.lightning_tests),
                ["pyproject.toml", "tests"],
                "tests",
                picked_l or LIGHTNING_FILES,
                "compat.substitute_lightning",
                ignore=[] if picked_l else LIGHTNING_IGNORE,
                modes=["io", "callback"] if args.mode == "both" else [args.mode],
            )
        )
    if args.framework in ("accelerate", "all") and (picked_a or not args.selection):
        frameworks.append(
            Framework(
                "accelerate",
                accelerate_tree(args.accelerate_tests),
                ["tests"],
                ".",
                picked_a or ACCELERATE_FILES,
                "compat.substitute_accelerate",
            )
        )
    if args.framework in ("transformers", "all") and (picked_t or not args.selection):
        frameworks.append(
            Framework(
                "transformers",
                transformers_tree(args.transformers_tests),
                ["pyproject.toml", "tests"],
                ".",
                picked_t or TRANSFORMERS_FILES,
                "compat.substitute_transformers",
                # The tests that load a tokenizer or processor from the Hub fail at once without a network
                # rather than retry; HF_HUB_OFFLINE=0 in the environment lets them download.
                env={"HF_HUB_OFFLINE": "1"},
            )
        )
    if not frameworks:
        print("compat: nothing selected")
        return 2
    exceptions = read_exceptions()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="air-compat-")
    code = snapshot_code(args.code, os.path.join(tmp, "_plugins"))
    print(f"compat: our code: {code}", flush=True)
    report: dict[str, Any] = {"exceptions_doc": EXCEPTIONS_DOC, "code": code, "runs": []}
    regressions = 0
    try:
        for fw in frameworks:
            print(f"compat: {fw.name} tests from {fw.src}", flush=True)
            stock = stock_from(args.stock_from, fw.name) if args.stock_from else None
            stock = stock or run_pytest(fw, None, False, tmp, args, args.log_dir)
            for mode in fw.modes:
                ours = run_pytest(fw, mode, True, tmp, args, args.log_dir)
                label = fw.name + (f" ({mode})" if mode else "")
                # an earlier run's selection may be larger: compare what ran now
                base = {t: r for t, r in stock.items() if t in ours} if args.stock_from else stock
                result = rerun_alone(fw, mode, compare(base, ours, exceptions), tmp, args)
                print_report(label, result)
                regressions += result["counts"]["regressions"]
                report["runs"].append(
                    {
                        "framework": fw.name,
                        "mode": mode,
                        "tree": fw.src,
                        "files": fw.files,
                        "k": args.k,
                        **{
                            k: result[k]
                            for k in (
                                "counts",
                                "rows",
                                "regressions",
                                "documented",
                                "metadata_hidden",
                                "parallel_only",
                            )
                        },
                        "ours_failures": {
                            t: {k: ours[t][k] for k in ("outcome", "message", "longrepr")}
                            for t in result["regressions"] + result["documented"]
                            if t in ours
                        },
                        "hide_metadata": args.hide_metadata,
                        "stock": {t: r["outcome"] for t, r in stock.items()},
                        "ours": {t: r["outcome"] for t, r in ours.items()},
                    }
                )
    finally:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
            print(f"compat: wrote {args.json}")
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n=== summary ===")
    for run in report["runs"]:
        c = run["counts"]
        label = run["framework"] + (f" ({run['mode']})" if run["mode"] else "")
        print(
            f"{label:22} stock pass {c['stock_pass']:4}  ours pass {c['ours_pass_of_stock_pass']:4}  "
            f"regressions {c['regressions']:4}  documented {c['documented_exceptions']:3}"
            + (f"  passed alone {c['parallel_only']:3}" if c.get("parallel_only") else "")
        )
    print(f"exceptions are listed in {os.path.relpath(EXCEPTIONS_DOC, os.getcwd())}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
