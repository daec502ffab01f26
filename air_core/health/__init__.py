"""Node health: pre-flight checks before the first step (``preflight``), the hang watchdog
(``watchdog``) and straggler scores (``stragglers``)."""

from .checks import CheckResult
from .preflight import CHECKS, PreflightReport, run_preflight, stop_if_bad
from .stragglers import Scores, SectionTimer, StragglerDetector, Stragglers, score, window_median
from .watchdog import HANG_EXIT_CODE, ExitOnHang, Hang, Watchdog

__all__ = [
    "CHECKS",
    "HANG_EXIT_CODE",
    "CheckResult",
    "ExitOnHang",
    "Hang",
    "PreflightReport",
    "Scores",
    "SectionTimer",
    "StragglerDetector",
    "Stragglers",
    "Watchdog",
    "run_preflight",
    "score",
    "stop_if_bad",
    "window_median",
]
