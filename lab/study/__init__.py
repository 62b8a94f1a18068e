"""A study, many runs as one: aggregate.py (the summary table), stats.py (paired statistics, seeds needed),
claims.py (the claims engine of every study: claims_file.py reads a claims file, claims_base.py holds the
verdicts and the registry of test kinds, claims_summary.py, claims_trajectory.py and claims_runs.py the kinds).
Imports lab.core (and the packages beside it below run); never run, report or diagnose."""
