"""Two draws of the same study, verdict by verdict: do they contradict each other?

    python benchmarks/calibration/verdict_stability.py results/tables results_t2/tables [--out results/benchmarks/draws.json]

Each folder holds a study's summary.csv and claims.md (the same commit run on another machine, or with another
`threads:`: another accumulation order, so other trajectories). A contradiction is a cost against a gain or against
"equivalent", or a supported claim against a contradicted one; a resolved difference (cost, gain, negligible) that
one draw finds and the other does not is counted apart: the rare exception the study's error rate allows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lab.core import files  # noqa: E402

METRICS = ("top1", "val_loss")
RESOLVED = {"cost", "gain", "negligible"}
CONTRADICTING = [{"cost", "gain"}, {"cost", "equivalent"}, {"gain", "equivalent"}]


def claims_verdicts(md: Path) -> dict:
    """{claim id: verdict} from a claims.md table."""
    out = {}
    for line in md.read_text().splitlines():
        if line.startswith("| ") and "(`" in line:
            cid = line.split("(`", 1)[1].split("`)", 1)[0]
            out[cid] = line.split(" | ")[1].strip().strip("*")
    return out


def compare(a: Path, b: Path) -> dict:
    sa, sb = (pd.read_csv(d / "summary.csv").set_index(["model", "mode"]) for d in (a, b))
    cells, contradictions, one_draw = 0, [], []
    for key in sa.index.intersection(sb.index):
        for m in METRICS:
            va, vb = sa.loc[key, f"{m}_verdict"], sb.loc[key, f"{m}_verdict"]
            if va == "reference":
                continue
            cells += 1
            if {va, vb} in CONTRADICTING:
                contradictions.append(f"{key[0]} {key[1]} {m}: {va} / {vb}")
            elif (va in RESOLVED) != (vb in RESOLVED):
                one_draw.append(f"{key[0]} {key[1]} {m}: {va} / {vb}")
    ca, cb = claims_verdicts(a / "claims.md"), claims_verdicts(b / "claims.md")
    claims_contra = [f"{c}: {ca[c]} / {cb[c]}" for c in ca if c in cb
                     and {ca[c], cb[c]} == {"supported", "contradicted"}]
    claims_diff = [f"{c}: {ca[c]} / {cb[c]}" for c in ca if c in cb and ca[c] != cb[c]]
    return {"cells": cells, "contradictions": contradictions, "resolved_in_one_draw_only": one_draw,
            "differing_cells": sum(sa.loc[k, f"{m}_verdict"] != sb.loc[k, f"{m}_verdict"]
                                   for k in sa.index.intersection(sb.index) for m in METRICS),
            "claims": len(ca), "claims_contradicting": claims_contra, "claims_differing": claims_diff,
            "a": str(a), "b": str(b)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = compare(args.a, args.b)
    if args.out:
        files.atomic_write_json(args.out, out)
    print(json.dumps(out, indent=2))
    return 1 if out["contradictions"] or out["claims_contradicting"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
