#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/ckptd-task-prolog.sh): runs as the job's user before each
# task, and Slurm adds each `export NAME=value` line it prints to the task's environment. So every task (the batch
# script, each srun task) finds the daemon ckptd-prolog.sh started for the job through CKPTD_RUN_DIR, and a client
# never spawns a daemon of its own beside it.
set -eu
SCRIPT=task-prolog
. "$(dirname "$0")/ckptd-common.sh"
echo "export CKPTD_RUN_DIR=$RUN_DIR"
