#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/ckptd-prolog.sh, PrologFlags=Alloc): start the job's ckptd daemon on
# this node before the job runs, as the job's user, in the run directory the task prolog names to the job's tasks.
# On a job of several nodes the daemon also opens its peer endpoint and replicates every memory snapshot to its
# buddy, the next node of the job's node list (the last node's buddy is the first), trusting the job's nodes only:
# each node's prolog publishes its key line (`ckptd peer-key`) in the job's directory on the shared filesystem and
# waits for the others'. A prolog that fails makes Slurm drain the node and requeue the job, so no job runs without
# its daemon. See README.md beside this script.
set -eu
SCRIPT=prolog
. "$(dirname "$0")/ckptd-common.sh"

NODES=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?}}")  # a prolog gets SLURM_NODELIST
COUNT=$(printf '%s\n' "$NODES" | wc -l)

# The run directory: node-local, the job user's own (the daemon refuses one that is not).
mkdir -p "$CKPTD_RUN_BASE"
chmod 0755 "$CKPTD_RUN_BASE"
rm -rf "$RUN_DIR"
mkdir -m 0700 "$RUN_DIR"
chown "$SLURM_JOB_UID:${SLURM_JOB_GID:-$SLURM_JOB_UID}" "$RUN_DIR"
as_user mkdir -p -m 0700 "$JOB_DIR"

ROOTS=""
OLD_IFS=$IFS
IFS=:
for root in $CKPTD_ROOTS; do
    ROOTS="$ROOTS --root $root"
done
IFS=$OLD_IFS

if [ "$COUNT" -lt 2 ]; then
    # One node: no other node to hold a replica, so no peer port.
    # shellcheck disable=SC2086
    ckptd_cmd start --run-dir "$RUN_DIR" $ROOTS --drain-timeout "$CKPTD_DRAIN_TIMEOUT" $CKPTD_START_OPTIONS >&2
    exit 0
fi

ME="tcp://$CKPTD_PEER_HOST:$CKPTD_PEER_PORT"
LINE=$(ckptd_cmd peer-key --run-dir "$RUN_DIR" --endpoint "$ME")
as_user sh -c 'printf "%s\n" "$1" > "$2.tmp" && mv "$2.tmp" "$2"' - "$LINE" "$JOB_DIR/$NODE.key"

# Wait for every node's line, then gather them in the node list's order: this node's buddy is the next one.
waited=0
while :; do
    missing=""
    for node in $NODES; do
        as_user test -s "$JOB_DIR/$node.key" || missing="$missing $node"
    done
    [ -z "$missing" ] && break
    if [ "$waited" -ge "$((CKPTD_KEYS_WAIT * 2))" ]; then
        say "no peer key from$missing in $JOB_DIR after $CKPTD_KEYS_WAIT s: do the prologs run at allocation" \
            "(PrologFlags=Alloc in slurm.conf), and do the nodes share $CKPTD_JOBS_DIR?"
        exit 1
    fi
    sleep 0.5
    waited=$((waited + 1))
done
KEYS="$RUN_DIR/peer-keys"
as_user sh -c 'shift_dir=$1; shift; for n in "$@"; do cat "$shift_dir/$n.key"; done' - "$JOB_DIR" $NODES \
    | as_user sh -c 'cat > "$1"' - "$KEYS"
NEXT=$(printf '%s\n%s\n' "$NODES" "$NODES" | awk -v me="$NODE" 'found { print; exit } $0 == me { found = 1 }')
BUDDY=$(as_user cat "$JOB_DIR/$NEXT.key" | awk '{ print $2 }')
# shellcheck disable=SC2086
ckptd_cmd start --run-dir "$RUN_DIR" $ROOTS --drain-timeout "$CKPTD_DRAIN_TIMEOUT" --peer-listen "$ME" --peer "$BUDDY" --peer-keys "$KEYS" \
    $CKPTD_START_OPTIONS >&2
say "daemon started, peer endpoint $ME, buddy $NEXT at $BUDDY"
