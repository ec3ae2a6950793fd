"""pytest plugin (``-p skip_reasons``, as scripts/test.sh loads it): the run ends with one line per
reason a test skipped and how many tests it skipped, so a reader sees at once what a machine
without a GPU, CUDA MPS or Triton did not run."""
from collections import Counter

_reasons = Counter()


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def pytest_terminal_summary(terminalreporter):
    _reasons.update(_reason(report) for report in terminalreporter.stats.get("skipped", []))


def pytest_unconfigure(config):
    """After pytest's own last line (the counts), so these lines end the run."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not _reasons:
        return
    reporter.write_line(f"skipped, by reason ({sum(_reasons.values())} tests):")
    for reason, count in sorted(_reasons.items(), key=lambda item: (-item[1], item[0])):
        reporter.write_line(f"{count:5d}  {reason}")
