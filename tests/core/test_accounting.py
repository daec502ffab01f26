"""``accounting.account`` on event logs written by hand: what each figure is made of."""

from __future__ import annotations

import json

import pytest

from air_core.cli import main
from air_core.session.accounting import Prices, account, as_metrics, lines


def _launch(start: float, world: int, steps: range, *extra: dict) -> list[dict]:
    events = [{"e": "start", "t": start, "launch": f"l{start}", "world": world}]
    events += [{"e": "step", "s": s, "t": start + s, "d": 1.0, "f": 0.1, "n": 8} for s in steps]
    return events + sorted(extra, key=lambda e: e["t"])


def test_figures_come_from_saves_deletes_counts_and_restores():
    save = {"e": "save", "committed": True, "blocking": 0.1, "total": 1.0, "bytes": 100}
    first = _launch(
        0.0,
        2,
        range(1, 11),
        save | {"s": 5, "t": 5.5, "staged": 200, "uploaded": 200, "linked": 0, "staging_disk": 300},
        {"e": "delete", "s": 1, "t": 6.0, "bytes": 150},
        {"e": "counts", "s": 8, "t": 8.5, "data_cache_hits": 3, "data_cache_misses": 1,
         "data_cache_bytes_downloaded": 4096, "restore_downloaded_bytes": 0},
    )  # fmt: skip
    # The relaunch (world 1) resumed from step 5: steps 6-10 of the first launch were done again.
    second = _launch(
        20.0,
        1,
        range(6, 13),
        {
            "e": "restore",
            "s": 5,
            "t": 20.5,
            "seconds": 0.4,
            "source": "remote",
            "tier": "remote",
            "bytes": 70,
        },
        save | {"s": 10, "t": 31.0, "staged": 100, "uploaded": 40, "linked": 60, "staging_disk": 900},
    )
    out = account([first, second], stored=5000, prices=Prices(gpu_hour=3600.0, egress_gb=1e9))
    assert out["bytes"] == {
        "staged": 300,
        "uploaded": 240,
        "linked": 60,
        "in_place": 0,  # no save of these wrote a local root in place
        "deleted": 150,
        "stored": 5000,
        "restore_downloaded": 70,  # no counts in the relaunch's log: its restore records
        "staging_peak": 900,
        "data_cache_downloaded": 4096,
    }
    assert out["data_cache"] == {"hits": 3, "misses": 1, "hit_rate": 0.75}
    (failure,) = out["work"]["per_failure"]
    assert failure == {
        "launch": 1,
        "resumed_from_step": 5,
        "recomputed_steps": 5,
        "recomputed_seconds": 5.0,
        "repeated_samples": 5 * 8 * 2,  # rank 0's samples per step times the first launch's world
    }
    cost = out["cost"]
    assert cost["gpu_recomputed_work"] == pytest.approx(5.0 * 2)  # seconds x ranks x 1 per second
    assert cost["egress_restore"] == pytest.approx(70.0) and "storage_per_month" not in cost
    assert as_metrics(out)["bytes_linked"] == 60.0 and as_metrics(out)["work_repeated_samples"] == 80.0
    assert any(
        line.startswith("failure after launch 1: resumed from step 5; 5 step(s)") for line in lines(out)
    )


def test_a_launch_s_last_counts_hold_every_rank_s_restore_downloads():
    counts = {"e": "counts", "s": 4, "t": 4.5, "restore_downloaded_bytes": 300}
    restore = {
        "e": "restore",
        "s": 0,
        "t": 0.5,
        "seconds": 0.1,
        "source": "remote",
        "tier": "remote",
        "bytes": 100,
    }
    launch = _launch(0.0, 3, range(1, 5), restore, counts)
    assert account([launch], stored=0)["bytes"]["restore_downloaded"] == 300
    assert "cost" not in account([launch], stored=0)


def test_air_report_json_without_prices_has_no_cost_and_a_price_must_be_a_number(tmp_path, capsys):
    assert main(["report", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "cost" not in report and report["bytes"]["uploaded"] == 0 and report["work"]["failures"] == 0
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path), "--egress-gb-price", "cheap"])
    assert exit_.value.code == 2 and "--egress-gb-price: 'cheap' is not a price" in capsys.readouterr().err
