"""A study, many runs as one: aggregate.py (the summary table), stats.py (paired statistics, seeds needed),
claims.py and claims_file.py (the source study's claims, checked against the summary table).
Imports lab.core (and the packages beside it below run); never run, report or diagnose."""
