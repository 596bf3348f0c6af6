"""A pytest plugin (loaded by conftest.py): one line that says what was skipped and why, and on
CI a skipped containment test is a failure.

CI's machine has every containment layer (cgroup v2 delegation, PID namespaces, Landlock), so
there a containment test that skips means a layer went missing, and must not pass as green.
Elsewhere such tests skip with the reason, and the summary line says so.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator
from typing import Any

import pytest

#: Test files that prove a containment layer, besides every file of ``tests/wall``; a skip
#: reason naming containment counts too.
CONTAINMENT_FILES = frozenset(
    {
        "test_containment.py",
        "test_landlock.py",
        "test_toolkit.py",
    }
)


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def _is_containment(item: pytest.Item, reason: str) -> bool:
    in_wall = item.path.parent.name == "wall"
    return in_wall or item.path.name in CONTAINMENT_FILES or reason.startswith("containment ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if _is_containment(item, reason):
        report.outcome = "failed"
        report.longrepr = (
            "a containment test skipped on CI, where every layer must be available "
            f"(CI={os.environ['CI']}): {reason}"
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = Counter(_reason(report) for report in skipped)
    why = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common())
    terminalreporter.write_line(f"skipped: {len(skipped)}" + (f" ({why})" if why else ""))
