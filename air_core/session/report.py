"""What ``air report`` shows besides goodput and accounting: checkpoint latencies, fetch_seconds,
restores, pre-flights, stragglers, hangs and ranks stopped for a lost peer of every launch, from the
goodput log (``goodput.py``), as one JSON-able object and as its text, and the report's plot."""

from __future__ import annotations

import os
from typing import Any

from ..layout import hang_stacks_path
from .goodput import restores
from .metrics import summarize


def measures(launches: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What the report prints before the goodput split, as one JSON-able object: the text is printed
    from it (``measure_lines``), so ``--json`` holds the same figures. Seconds throughout."""
    saves = [e for events in launches for e in events if e["e"] == "save" and e.get("committed")]
    steps = [e for events in launches for e in events if e["e"] == "step"]
    fetch = summarize([e["f"] for e in steps])
    step_sum = sum(e["d"] for e in steps) or 1.0
    restored = [
        {"launch": i + 1, "step": r["s"], "tier": r.get("tier", "remote"), "source": r["source"]}
        | {"seconds": r["seconds"], "steps_lost": lost}
        for i, r, lost in restores(launches)
    ]
    preflights = [
        {"launch": i, "status": e["status"], "seconds": e["seconds"], "problems": e["problems"]}
        for i, events in enumerate(launches, 1)
        for e in events
        if e["e"] == "preflight"
    ]
    hangs = [
        {"launch": i, "rank": e["rank"], "host": e["host"], "step": e["s"], "since_seconds": e["since"]}
        | {"limit_seconds": e["limit"], "stacks": hang_stacks_path(e["launch"], e["rank"])}
        for i, events in enumerate(launches, 1)
        for e in events
        if e["e"] == "hang" and not e.get("lost")
    ]
    lost = [
        {"launch": i, "rank": e["rank"], "host": e["host"], "step": e["s"], "lost": e["lost"]}
        for i, events in enumerate(launches, 1)
        for e in events
        if e["e"] == "hang" and e.get("lost")
    ]
    return {
        "checkpoints": {
            "committed": len(saves),
            "blocking_seconds": summarize([e["blocking"] for e in saves]),
            "save_to_commit_seconds": summarize([e["total"] for e in saves]),
        },
        "fetch_seconds": {"steps": len(steps), **fetch, "data_wait_fraction": fetch["sum"] / step_sum},
        "restores": restored,
        "preflight": preflights,
        "stragglers": _stragglers([e for events in launches for e in events if e["e"] == "straggler"]),
        "hangs": hangs,
        "lost_peers": lost,
    }


def measure_lines(measured: dict[str, Any]) -> list[str]:
    """The text of ``measures``: checkpoint latencies, fetch_seconds, restores, pre-flights,
    stragglers and hangs, one line each (a pre-flight's problems indented below it)."""
    saves, fetch = measured["checkpoints"], measured["fetch_seconds"]
    b, total = saves["blocking_seconds"], saves["save_to_commit_seconds"]
    f = {k: fetch[k] * 1e3 for k in ("p50", "p95", "max")}
    out = [
        f"checkpoints: {saves['committed']} committed; blocking p50 {b['p50']:.3f} s, p95 {b['p95']:.3f} s, "
        f"max {b['max']:.3f} s; save to commit p50 {total['p50']:.2f} s",
        f"fetch_seconds: {fetch['steps']} steps, p50 {f['p50']:.2f} ms, p95 {f['p95']:.2f} ms, "
        f"max {f['max']:.2f} ms; data-wait fraction {fetch['data_wait_fraction']:.3f}",
    ]
    for r in measured["restores"]:
        lost = f"; {r['steps_lost']} step(s) lost" if r["steps_lost"] is not None else ""
        out.append(
            f"restore: step {r['step']} from the {r['tier']} tier ({r['source']} copy) in "
            f"{r['seconds']:.2f} s{lost}"
        )
    for p in measured["preflight"]:
        out.append(f"pre-flight (launch {p['launch']}): {p['status']} in {p['seconds']:.2f} s")
        out += [
            f"  {problem['status'].upper()} {problem['check']} on {problem['host']} rank "
            f"{problem['rank']}: {problem['message']}"
            for problem in p["problems"]
        ]
    out += [
        f"straggler: rank {s['rank']} ({s['host']}) in {s['windows']} window(s), steps {s['first_step']}-"
        f"{s['last_step']}; lowest relative score {s['lowest_relative_score']:.2f}, individual "
        f"{s['lowest_individual_score']:.2f}"
        for s in measured["stragglers"]
    ]
    out += [
        f"hang (launch {h['launch']}): rank {h['rank']} on {h['host']} after step {h['step']}, no progress "
        f"for {h['since_seconds']:.1f} s (limit {h['limit_seconds']:.1f} s); stacks in {h['stacks']}"
        for h in measured["hangs"]
    ]
    out += [
        f"stopped (launch {s['launch']}): rank {s['rank']} on {s['host']} after step {s['step']}, having "
        f"lost {s['lost']} (ended without ending its training)"
        for s in measured["lost_peers"]
    ]
    return out


def _stragglers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rank a metrics window named a straggler: its windows, steps and lowest scores."""
    by_rank: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    for e in events:
        for rank, host, rel, ind in zip(e["ranks"], e["hosts"], e["relative"], e["individual"], strict=True):
            by_rank.setdefault((rank, host), []).append((e["s"], rel, ind))
    out = []
    for (rank, host), seen in sorted(by_rank.items()):
        steps = [s for s, _, _ in seen]
        out.append(
            {"rank": rank, "host": host, "windows": len(seen), "first_step": min(steps)}
            | {"last_step": max(steps), "lowest_relative_score": min(r for _, r, _ in seen)}
            | {"lowest_individual_score": min(i for _, _, i in seen)}
        )
    return out


def plot_problem(path: str) -> str | None:
    """Why ``--plot PATH`` cannot be drawn, found before the report is printed, else None."""
    if os.path.isdir(path):
        return f"--plot {path} is a folder; pass a PNG file's path, e.g. {os.path.join(path, 'report.png')}"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        return f"--plot {path}: {folder} {what}; pass a PNG file's path in an existing folder"
    try:
        import matplotlib  # noqa: F401  (imported again to draw: found here, before the report)
    except ImportError:
        return "--plot needs matplotlib, which is not installed: pip install matplotlib"
    return None


def plot(path: str, launches: list[list[dict[str, Any]]], result: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10))
    for i, events in enumerate(launches):
        steps = [e for e in events if e["e"] == "step"]
        ax1.plot([e["s"] for e in steps], [e["f"] * 1e3 for e in steps], ".", ms=3, label=f"launch {i + 1}")
    ax1.set(title="fetch_seconds per step", xlabel="step", ylabel="ms")
    ax1.legend()
    saves = [e for events in launches for e in events if e["e"] == "save" and e.get("committed")]
    xs = [e["s"] for e in saves]
    ax2.bar([str(x) for x in xs], [e["blocking"] for e in saves], label="blocking")
    below = [e["blocking"] for e in saves]
    above = [e["total"] - e["blocking"] for e in saves]
    ax2.bar([str(x) for x in xs], above, bottom=below, label="background (stage, upload, commit)")
    ax2.set(title="checkpoint phases per save", xlabel="step", ylabel="s")
    ax2.legend()
    parts = {
        "productive": result.productive,
        "checkpoint stalls": result.checkpoint_stalls,
        "data waits": result.data_waits,
        "start-up": result.startup,
        "restore": result.restore,
        "recomputed": result.recomputed,
        "lost to hangs": result.hangs,
        "other": result.other,
    }
    ax3.barh(list(parts), list(parts.values()))
    ax3.set(title=f"goodput {result.goodput:.1%} of {result.wall:.1f} s", xlabel="s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
