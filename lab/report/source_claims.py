"""The README's one table of the source study's claims across every study that decides some: each claim
of the committed claims files whose `source:` is the source study, where it was decided, its verdict, a link to the
evidence. `python -m lab claims --readme README.md` (`make claims`) writes it between the claims markers;
tests/test_doc_claims.py checks the committed README against it.

Which studies: configs/default.yaml (configs/claims.yaml) and every config in configs/ that names a claims file of its
own (`claims_file:`, or an RL study's `claims:`; the fault and token studies reuse the default's file to check the
machinery, not to decide) and whose `results_dir` holds a committed tables/claims.md (the verdicts `lab claims` / `lab rl-claims` wrote there).
A claim declared in several studies (the default study's overflow claims, decided at the growth horizon; the RL
scaler claims, decided again at their asked sizes in configs/rl-long.yaml) gets one row: the verdict of the study
that decided it (supported or contradicted; else the last study in STUDY_ORDER that has a verdict), the others'
verdicts beside it. Nothing here decides anything: the verdicts are the claims files' engines', read back.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

__all__ = ["source_claims", "readme_table", "is_source", "read_verdicts", "studies"]

#: the order studies are listed in (a later one's verdict wins when neither decides); others follow by name
STUDY_ORDER = ("default", "growth_horizon", "finetune", "qlora", "multimodal", "rl", "rl-long", "fp8", "qat", "alerts",
               "fsdp-unscale", "long-context")
LABELS = {"default": "default study", "growth_horizon": "growth horizon", "finetune": "fine-tune", "qlora": "QLoRA",
          "multimodal": "multimodal", "rl": "RL", "rl-long": "RL, long runs", "fp8": "FP8", "qat": "QAT",
          "alerts": "alert thresholds", "fsdp-unscale": "FSDP + AMP", "long-context": "long context"}
DECIDED = ("supported", "contradicted")
_SOURCE = re.compile(r"^(the )?source\b|^(implied by )?the source('s| study's)|^source's")
_ID_SUMMARY = re.compile(r"\(`([\w.+-]+)`\) \|")      # lab claims: "| text (`id`) | **verdict** | ..."
_ID_RUNS = re.compile(r"^\| \*\*([\w.+-]+)\*\*: ")     # lab rl-claims: "| **id**: text | **verdict** | ..."
_VERDICT = re.compile(r"\*\*(supported|contradicted|not resolved|out of reach)\*\*")


def is_source(source: str) -> bool:
    """A claim's `source:` names the source study (the blog post the lab checks), not another paper or the lab."""
    return bool(_SOURCE.search(str(source).strip().lower()))


def studies(root: Path) -> list[dict]:
    """[{name, label, config, claims, results, table}] for the configs whose claims.md is committed, in STUDY_ORDER."""
    found = {}
    for cfg in sorted((root / "configs").glob("*.yaml")):
        raw = yaml.safe_load(cfg.read_text()) or {}
        if not isinstance(raw, dict) or "results_dir" not in raw or cfg.name.startswith("claims"):
            continue
        claims = raw.get("claims_file") or raw.get("claims") or ("configs/claims.yaml" if cfg.name == "default.yaml"
                                                                  else None)
        results = str(raw["results_dir"]).rstrip("/")
        table = f"{results}/tables/claims.md"
        if not isinstance(claims, str) or not (root / table).is_file() or not (root / claims).is_file():
            continue
        name = "default" if results == "results" else Path(results).name
        found.setdefault(name, {"name": name, "label": LABELS.get(name, name.replace("_", " ")),
                                "config": f"configs/{cfg.name}", "claims": claims, "results": results,
                                "table": table})
    rank = {n: i for i, n in enumerate(STUDY_ORDER)}
    return sorted(found.values(), key=lambda s: (rank.get(s["name"], math.inf), s["name"]))


def read_verdicts(text: str) -> dict[str, str]:
    """claim id -> verdict, from a claims.md of either engine command (a claim's first row carries its verdict)."""
    out = {}
    for line in text.splitlines():
        m = _ID_RUNS.match(line) or _ID_SUMMARY.search(line)
        v = _VERDICT.search(line.split(m.group(0), 1)[1] if m else "")
        if m and v and m.group(1) not in out:
            out[m.group(1)] = v.group(1)
    return out


def source_claims(root: Path, tables: dict[str, str] | None = None) -> list[dict]:
    """One record per source claim: {id, text, where: [(study, verdict)], study, verdict}. ``tables``: claims file
    -> the claims.md text to read instead of the committed one (what `lab claims` has just decided)."""
    rows: dict[str, dict] = {}
    fresh = {Path(k).resolve(): v for k, v in (tables or {}).items()}
    for st in studies(root):
        path = root / st["table"]
        text = fresh.get((root / st["claims"]).resolve(), path.read_text() if path.is_file() else "")
        verdicts = read_verdicts(text)
        for claim in (yaml.safe_load((root / st["claims"]).read_text()) or {}).get("claims", []):
            if not is_source(claim.get("source", "")):
                continue
            row = rows.setdefault(claim["id"], {"id": claim["id"], "text": claim["text"], "where": []})
            row["where"].append((st, verdicts.get(claim["id"], "not yet run")))
    for row in rows.values():
        decided = [w for w in row["where"] if w[1] in DECIDED]
        ran = [w for w in row["where"] if w[1] != "not yet run"]
        row["study"], row["verdict"] = (decided or ran or row["where"])[-1]
    return list(rows.values())


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def readme_table(root: Path, tables: dict[str, str] | None = None, extra: str = "") -> str:
    """The README's claims section: claim | decided in | verdict | evidence."""
    records = source_claims(root, tables)
    lines = ["| the source's claim | decided in | verdict | evidence |", "|---|---|---|---|"]
    for r in records:
        st = r["study"]
        others = "; ".join(f"{o['label']}: {v}" for o, v in r["where"] if o is not st)
        where = f"{st['label']}" + (f" ({others})" if others else "")
        lines.append(f"| {_cell(r['text'])} (`{r['id']}`) | {where} | **{r['verdict']}** | "
                     f"[{st['table']}]({st['table']}) |")
    counts = {v: sum(r["verdict"] == v for r in records) for v in (*DECIDED, "not resolved", "out of reach")}
    tally = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    lines += ["", f"{len(records)} claims of the source study ({tally}), each decided by its study's claims engine "
              "(declared in `configs/claims*.yaml` before that study's runs; Holm over each file's tests, "
              "family-wise error 5%), read back from the committed `claims.md` by `make claims`; a claim declared "
              "in several studies shows the one that decided it, the others in brackets. Method: "
              "[docs/statistics.md](docs/statistics.md)." + (f" {extra}" if extra else "")]
    return "\n".join(lines) + "\n"
