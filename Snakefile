# Loss-Scale Lab: reproduce the loss-scaling study.  `snakemake --cores N` (see README).
# The rules are thin: every step calls `python -m lab ...`; all logic lives in the lab package.
from snakemake.utils import min_version

min_version("9.0")


# `--configfile X` replaces the default study instead of merging into it (several files merge in order).
if not workflow.overwrite_configfiles:

    configfile: "configs/default.yaml"


# The RL study (configs/rl.yaml says `study: rl`) has rules of its own (workflow/rules/rl.smk, docs/rl.md).
if config.get("study") == "rl":

    include: "workflow/rules/rl.smk"

    # Its DPO family (a `dpo:` block in the config): workflow/rules/rl_dpo.smk
    if RL["dpo"]:

        include: "workflow/rules/rl_dpo.smk"

    rule all:
        default_target: True
        input:
            RL_TARGETS,
            DPO_TARGETS if RL["dpo"] else [],

# The alert-threshold study (configs/alerts.yaml says `study: alerts`) reads runs that exist: workflow/rules/alerts.smk.
elif config.get("study") == "alerts":

    include: "workflow/rules/alerts.smk"

    rule all:
        default_target: True
        input:
            ALERT_TARGETS,

else:

    include: "workflow/rules/common.smk"
    include: "workflow/rules/controllers.smk"
    include: "workflow/rules/train.smk"
    include: "workflow/rules/aggregate.smk"
    include: "workflow/rules/report.smk"
    include: "workflow/rules/claims.smk"
    include: "workflow/rules/replay.smk"
    include: "workflow/rules/recipes.smk"
    include: "workflow/rules/positions.smk"


    # One study per folder at a time: an OS lock that a kill -9 cannot leave behind (profiles/default turns
    # Snakemake's own lock off so that the same command resumes a killed study; lab/core/lock.py).
    onstart:
        from lab.core import lock

        lock.hold()
        save_study(STUDY, STUDY_FILE)  # what the jobs read (workflow/rules/common.smk), once the lock is this study's
        start_job_server()  # local runs: training jobs forked from one warm process (workflow/rules/common.smk)


    # By now Snakemake has recorded every job that finished: the copies a finished run keeps for a workflow that
    # is killed before it records the run (lab/run/finished.py) are no longer needed.
    onsuccess:
        from lab.run import finished

        finished.drop(f"{RESULTS}/runs")
        stop_job_server()


    onerror:
        from lab.run import finished

        finished.drop(f"{RESULTS}/runs")
        stop_job_server()


    # `snakemake --report results/report.html`: this text opens the report (figures and table: report.smk).
    report: "workflow/report/workflow.rst"


    rule all:
        default_target: True
        input:
            SUMMARY_CSV,
            SUMMARY_MD,
            CLAIMS_MD,
            REPLAY_AGREEMENT_MD,
            COMPARE_TABLES,
            RECIPE_TABLES,
            POSITION_TABLES,
            CONTROLLER_TABLES,
            REPORT_OUTPUTS,
