# The alert-threshold study (configs/alerts.yaml, docs/alerts.md): the source's alert thresholds judged as detectors
# over runs that exist already (no rule trains): the diagnose catalogue's loops recorded once, then the tables, then
# the claims. Thin rules: each calls `python -m lab ...`; the Snakefile includes this file instead of the main study's
# rules when the config says `study: alerts`.
import glob
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # `import lab` from the repository root

from lab.core.errors import ConfigError
from lab.diagnose.alerts import load_alerts

try:
    ALERTS = load_alerts(config)
except ConfigError as err:
    raise WorkflowError(str(err))

ALERT_RESULTS = ALERTS["results_dir"]
ALERT_TABLES = f"{ALERT_RESULTS}/tables"
ALERT_CATALOGUE = ALERTS["catalogue"]
ALERT_RECORDED = f"{ALERT_CATALOGUE}/recorded.txt"
# the patterns that match here: a fresh clone has the committed per-run tables, not every study's run folders
ALERT_PATTERNS = [p for p in ALERTS["runs"] if glob.glob(p)]
ALERT_LEFT_OUT = [p for p in ALERTS["runs"] if p not in ALERT_PATTERNS]
ALERT_INPUTS = sorted({f"{m}/metrics.json" if not m.endswith(".csv") else m
                       for p in ALERT_PATTERNS for m in glob.glob(p)})
ALERT_OUTPUTS = [f"{ALERT_TABLES}/{name}" for name in
                 ("runs.csv", "detectors.csv", "studies.csv", "choice.csv", "alerts.md")]
ALERT_CLAIMS_MD = f"{ALERT_TABLES}/claims.md"
ALERT_TARGETS = [*ALERT_OUTPUTS, *([ALERT_CLAIMS_MD] if ALERTS["claims_file"] else [])]


rule alerts_catalogue:
    output:
        ALERT_RECORDED,
    params:
        out=lambda wc, output: str(Path(output[0]).parent),
    conda:
        "../envs/lab.yaml"
    log:
        f"{ALERT_RESULTS}/logs/catalogue.log",
    shell:
        "OMP_NUM_THREADS=1 python -m lab record-catalogue --out {params.out} > {output}.tmp 2> {log}"
        " && mv {output}.tmp {output}"


rule alert_thresholds:
    input:
        ALERT_INPUTS,
        catalogue=ALERT_RECORDED,
    output:
        ALERT_OUTPUTS,
    params:
        patterns=" ".join(f"'{p}'" for p in ALERT_PATTERNS),
        left_out="; ".join(ALERT_LEFT_OUT) or "none",
        configs=" ".join(f"'{p}'" for p in ALERTS["configs"]),
        catalogue=lambda wc, input: f"'{Path(input.catalogue).parent}/*/'",
        out=lambda wc, output: str(Path(output[0]).parent),
    conda:
        "../envs/lab.yaml"
    log:
        f"{ALERT_RESULTS}/logs/alert_thresholds.log",
    shell:
        "(echo 'patterns that match nothing here, left out: {params.left_out}';"
        " python -m lab alert-thresholds {params.patterns} {params.catalogue} --configs {params.configs}"
        " --out {params.out}) > {log} 2>&1"


rule alerts_claims:
    input:
        runs=f"{ALERT_TABLES}/runs.csv",
        claims=ALERTS["claims_file"] or [],
    output:
        ALERT_CLAIMS_MD,
    params:
        summary=f"{ALERT_TABLES}/summary.csv",  # none: a file that reads the per-run table alone
    conda:
        "../envs/lab.yaml"
    log:
        f"{ALERT_RESULTS}/logs/claims.log",
    shell:
        "python -m lab claims --claims {input.claims} --runs {input.runs} --summary {params.summary}"
        " --md {output} > {log} 2>&1"
