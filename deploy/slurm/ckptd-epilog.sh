#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/ckptd-epilog.sh): stop the job's daemon on this node once the job
# ended, as `ckptd stop` does: it finishes the saves in flight, persists the newest memory snapshot of each
# directory, and, on the buddy of a node the job lost, the replicas it holds of that node's snapshots (the origin
# no longer answers), so the next job resumes from disk. What it could not persist (a snapshot that spans several
# nodes: persist those with persist=True) is named in $CKPTD_JOBS_DIR/$SLURM_JOB_ID/<node>.stop and in slurmd's log.
# Then the run directory and the job user's shared-memory files that no live process owns are removed. It exits 0
# whatever the drain lost: a non-zero epilog would drain a healthy node. See README.md beside this script.
set -eu
SCRIPT=epilog
. "$(dirname "$0")/ckptd-common.sh"

[ -d "$RUN_DIR" ] || exit 0
STOPPED="$JOB_DIR/$NODE.stop"
rc=0
out=$(ckptd_cmd stop --run-dir "$RUN_DIR" --timeout "$CKPTD_STOP_TIMEOUT" 2>&1) || rc=$?
case $rc in
    0) ;;
    1) say "no daemon answered (it had exited): $out" ;;
    *) say "ckptd stop exited $rc: $out" ;;
esac
pid=$(cat "$RUN_DIR/ckptd.pid" 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q ckptd "/proc/$pid/cmdline" 2>/dev/null; then
    say "daemon $pid still draining after $CKPTD_STOP_TIMEOUT s: killed, its memory snapshots are lost"
    kill -KILL "$pid" || true
fi
if as_user test -d "$JOB_DIR"; then
    as_user sh -c 'printf "exit %s\n%s\n" "$1" "$2" > "$3"' - "$rc" "$out" "$STOPPED" || true
    as_user sh -c 'cat "$1" > "$2"' - "$RUN_DIR/ckptd.log" "$JOB_DIR/$NODE.ckptd.log" 2>/dev/null || true
    # Key lines are only for the job's start: a requeued job (same id, other nodes) must not trust stale ones.
    as_user sh -c 'rm -f "$1"/*.key' - "$JOB_DIR" || true
fi
rm -rf "$RUN_DIR"
# Shared-memory files of the job's user that no live process owns (ckptd-UID-PID-N: a trainer Slurm killed, a
# daemon killed above) would hold node memory until that user's next daemon on this node sweeps them.
SHM="${CKPTD_SHM_DIR:-/dev/shm}"
for f in "$SHM/ckptd-$SLURM_JOB_UID-"*; do
    [ -e "$f" ] || continue
    owner=${f#"$SHM/ckptd-$SLURM_JOB_UID-"}
    owner=${owner%%-*}
    kill -0 "$owner" 2>/dev/null || rm -f "$f"
done
exit 0
