#!/usr/bin/env bash
# End-to-end test of the SLURM profile (workflow/profiles/slurm), `make test-slurm`; CI runs it after `make test`.
#
#   1. installs Debian's slurm-wlm and munge when slurmctld/slurmd/sbatch/munged are missing (apt-get; root);
#   2. starts a one-node cluster on localhost: a private munged, slurmctld and slurmd, with a minimal slurm.conf
#      for this machine's CPUs and memory (`slurmd -C`), no accounting database, a job-completion log that
#      `sacct -c` reads; ports 16817/16818 and everything else under $SLURM_E2E_DIR (default /tmp/lsl-slurm-e2e);
#   3. copies the workflow (Snakefile, workflow/, lab/, configs/, profiles/) there, sets the profile's partition
#      to the test cluster's and removes its account line (as a user of a cluster without accounts would edit
#      it), and runs the tiny study workflow/tests/slurm_tiny.yaml with
#      `snakemake --executor slurm --profile workflow/profiles/slurm` (status by squeue: no accounting here);
#   4. runs the same study locally (`snakemake --cores 2`) and checks (workflow/tests/slurm_e2e_check.py) that
#      every job went through sbatch (sacct -c lists exactly the submitted jobs, all COMPLETED), that each left
#      its log under results/logs/slurm/, and that summary.csv (timing and memory columns aside) and every
#      steps.csv equal the local run's;
#   5. stops the cluster (also on failure or Ctrl-C) and prints PASS or FAIL; exit status 0 only on PASS.
#
# SLURM_E2E_KEEP=1 keeps $SLURM_E2E_DIR (study copies, logs, slurm.conf) after a PASS; it is always kept on FAIL.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=${SLURM_E2E_DIR:-/tmp/lsl-slurm-e2e}
CTLD_PORT=${SLURM_E2E_PORT:-16817}
export PATH="$REPO/.venv/bin:$PATH"   # the jobs call `python -m lab`; sbatch --export=ALL hands them this PATH
SECONDS=0
STARTED=0
FAILED=0

say() { printf '[slurm-e2e %3ds] %s\n' "$SECONDS" "$*"; }
fail() {
    say "$*"
    for f in "$WORK"/log/snakemake-slurm.log "$WORK"/log/slurmctld.log "$WORK"/log/slurmd.log; do
        [ -s "$f" ] && { echo "----- last lines of $f"; tail -n 25 "$f"; }
    done
    say "FAIL (files kept in $WORK)"
    FAILED=1
    exit 1
}

stop_pidfile() {  # stop the daemon (slurmd, slurmctld, munged) whose pid file this is, SIGKILL after 10 s
    local pidfile=$1 pid i name
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    name=$(basename "$pidfile" .pid)
    # only the daemon we started: a stale pid file's number may belong to another process by now
    if [ "$(ps -p "$pid" -o comm= 2>/dev/null)" != "$name" ]; then rm -f "$pidfile"; return 0; fi
    kill "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop_cluster() {
    local i
    if [ -S "$WORK/run/munge.socket" ] && [ -s "$WORK/run/slurmctld.pid" ]; then
        export SLURM_CONF=$WORK/slurm.conf
        scancel --quiet --user="$(id -un)" 2>/dev/null || true
        for i in $(seq 50); do   # let slurmd end the jobs' processes (KillWait=5)
            [ -z "$(squeue -h -t R,CG,S -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    stop_pidfile "$WORK/run/slurmd.pid"
    stop_pidfile "$WORK/run/slurmctld.pid"
    stop_pidfile "$WORK/run/munged.pid"
    if [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$WORK/slurm.conf" ]; then rm -f /etc/slurm/slurm.conf; fi
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    cd /
    [ "$rc" = 0 ] || [ "$FAILED" = 1 ] || say "FAIL (exit status $rc; files kept in $WORK)"
    if [ "$STARTED" = 1 ]; then say "stopping the cluster"; stop_cluster; fi
    if [ "$rc" = 0 ] && [ "${SLURM_E2E_KEEP:-0}" != 1 ]; then rm -rf "$WORK"; fi
    exit "$rc"
}
trap on_exit EXIT
trap 'fail "interrupted"' INT TERM

[ -x "$REPO/.venv/bin/python" ] || fail "no $REPO/.venv: run make first"
[ "$(id -u)" = 0 ] || fail "needs root (apt-get, and slurmd launches jobs): run it as root or in a container"

# ---- 1. SLURM and munge
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    aptlog=$(mktemp)
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$aptlog" 2>&1 \
        || { tail -n 20 "$aptlog"; fail "apt-get could not install slurm-wlm and munge"; }
    rm -f "$aptlog"
fi
say "$(slurmctld -V), munge $(munged -V 2>&1 | awk '{print $1}' | sed 's/munge-//')"

# ---- 2. the cluster (a previous run interrupted hard may have left its daemons: stop those first)
stop_cluster
rm -rf "$WORK"
mkdir -p "$WORK"/{munge,run,log,state,spool}
chmod 755 "$WORK" "$WORK/run"       # munged wants its socket's directory reachable by all
chmod 700 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"

HOST=$(hostname -s)
NODE=$(slurmd -C | head -n 1)       # NodeName=<host> CPUs=... RealMemory=... for this machine
NODE_MB=$(echo "$NODE" | grep -o 'RealMemory=[0-9]*' | cut -d= -f2)
cat > "$WORK/slurm.conf" <<EOF
# one-node test cluster written by workflow/tests/slurm_e2e.sh
ClusterName=lslab-e2e
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/run/munge.socket
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/run/slurmctld.pid
SlurmdPidFile=$WORK/run/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$WORK/log/jobcomp.log
MinJobAge=300
KillWait=5
ReturnToService=2
$NODE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=e2e Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$WORK/slurm.conf
# The commands find the cluster through SLURM_CONF, but the plugin's job step (snakemake-executor-plugin-slurm-
# jobstep) clears SLURM_* variables before its inner `srun`, which then reads the default /etc/slurm/slurm.conf
# (as on a real cluster): link ours there for the test, unless this machine has its own SLURM configuration.
if [ -e /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" != "$WORK/slurm.conf" ]; then
    fail "/etc/slurm/slurm.conf exists (a real SLURM setup?): run this test in a fresh container or VM"
fi
mkdir -p /etc/slurm
ln -sfn "$WORK/slurm.conf" /etc/slurm/slurm.conf

STARTED=1
munged --socket="$WORK/run/munge.socket" --key-file="$WORK/munge/munge.key" --pid-file="$WORK/run/munged.pid" \
    --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge/munged.seed" || fail "munged did not start"
slurmctld -c -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
state=""
for _ in $(seq 150); do
    state=$(sinfo -h -N -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.2
done
[ "$state" = idle ] || fail "the node is not idle after 30 s (state: '${state:-no answer}')"
say "cluster up: ${NODE%% Boards*} RealMemory=$NODE_MB, partition e2e"

# ---- 3. the tiny study through SLURM, in a copy of the workflow
STUDY=$WORK/study
mkdir -p "$STUDY"
parts=(Snakefile workflow lab configs)
[ -d "$REPO/profiles" ] && parts+=(profiles)   # the workflow profile Snakemake reads on every run
tar -C "$REPO" --exclude=__pycache__ -cf - "${parts[@]}" | tar -C "$STUDY" -xf -
python - "$STUDY/workflow/profiles/slurm/config.yaml" "$NODE_MB" <<'EOF' || fail "cannot use the profile here"
import sys, yaml
path, node_mb = sys.argv[1], int(sys.argv[2])
profile = yaml.safe_load(open(path))
profile["default-resources"]["slurm_partition"] = "e2e"
profile["default-resources"].pop("slurm_account", None)
yaml.safe_dump(profile, open(path, "w"), sort_keys=False)
biggest = max([profile["default-resources"]["mem_mb"]]
              + [r.get("mem_mb", 0) for r in profile.get("set-resources", {}).values()])
if biggest > node_mb:
    sys.exit(f"the profile asks for {biggest} MB per job; this node has {node_mb} MB")
EOF
CONFIG=workflow/tests/slurm_tiny.yaml
say "snakemake --executor slurm --profile workflow/profiles/slurm --configfile $CONFIG"
cd "$STUDY"
snakemake --executor slurm --profile workflow/profiles/slurm --configfile "$CONFIG" \
    --slurm-status-command squeue --slurm-init-seconds-before-status-checks 2 --seconds-between-status-checks 2 \
    > "$WORK/log/snakemake-slurm.log" 2>&1 || fail "the SLURM study failed (log: $WORK/log/snakemake-slurm.log)"
say "SLURM study done: $(grep -c 'has been submitted with SLURM jobid' "$WORK/log/snakemake-slurm.log") sbatch jobs"

# ---- 4. the same study locally, then the checks
snakemake --cores 2 --configfile "$CONFIG" --config results_dir=results-local \
    > "$WORK/log/snakemake-local.log" 2>&1 || fail "the local study failed (log: $WORK/log/snakemake-local.log)"
say "local study done"
python "$REPO/workflow/tests/slurm_e2e_check.py" --log "$WORK/log/snakemake-slurm.log" --study "$STUDY" \
    --slurm "$STUDY/results" --local "$STUDY/results-local" || fail "checks failed"
say "PASS"
