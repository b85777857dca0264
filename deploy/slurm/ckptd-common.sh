# Sourced by ckptd-prolog.sh, ckptd-epilog.sh and ckptd-task-prolog.sh: the settings, and what they share.
# shellcheck shell=sh

PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}"
export PATH
HERE=$(dirname "$0")
# shellcheck source=ckptd.conf
. "$HERE/ckptd.conf"

: "${SLURM_JOB_ID:?is not set: run this script as Slurm's Prolog, Epilog or TaskProlog}"
RUN_DIR="$CKPTD_RUN_BASE/$SLURM_JOB_ID"
JOB_DIR="$CKPTD_JOBS_DIR/$SLURM_JOB_ID"
NODE="${SLURMD_NODENAME:-$(hostname)}"

say() {
    # slurmd writes a prolog's and an epilog's stderr to its log; syslog gets it too where there is one
    echo "ckptd-$SCRIPT job $SLURM_JOB_ID on $NODE: $*" >&2
    logger -t ckptd -- "$SCRIPT job $SLURM_JOB_ID on $NODE: $*" 2>/dev/null || true
}

as_user() {
    # The daemon serves clients of its own uid only, so it runs as the job's user, as does everything it reads
    # or writes on the shared filesystem (where root may be squashed).
    if [ "$(id -u)" != 0 ]; then  # slurmd runs as an unprivileged SlurmdUser: the job's user must be that one
        "$@"
    else
        runuser -u "${SLURM_JOB_USER:?}" -- "$@"
    fi
}

ckptd_cmd() {
    # shellcheck disable=SC2086  # CKPTD may be several words ("python -m ckptd")
    as_user $CKPTD "$@"
}
