"""A study, many runs as one: aggregate.py (the summary table), stats.py (paired statistics, seeds needed),
claims/ (the claims engine of every study, a package: file.py reads a claims file, base.py holds the verdicts and
the registry of test kinds, summary.py, trajectory.py and runs.py the kinds, report.py the reports).
Imports lab.core (and the packages beside it below run); never run, report or diagnose."""
