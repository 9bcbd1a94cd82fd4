#!/bin/sh
# Slurm Epilog for berth: runs `berth epilog`, which reads the job from Slurm's environment
# (SLURM_JOB_ID, SLURM_JOB_UID, …, and SPANK_BERTH_IMAGE set by the SPANK plugin).
# Slurm runs it as root with no PATH at all; this wrapper sets one for berth and what it runs.
# Install as in configs/slurm/README.md: slurm.conf Epilog=/etc/slurm/berth-epilog.sh
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# The berth binary, and arguments before the verb (e.g. BERTH_ARGS="--config /etc/berth/berth.toml").
BERTH=/usr/local/bin/berth
BERTH_ARGS=
# Slurm drains a node whose Epilog fails with the reason "Epilog error"; berth's one line says
# what is wrong (a cleanup step, or the health checks), so the node is drained with that line as
# the reason instead (the line also goes to slurmd's log).
# shellcheck disable=SC2086 # BERTH_ARGS holds several words on purpose
out=$("$BERTH" $BERTH_ARGS epilog 2>&1) && exit 0
printf '%s\n' "$out" >&2
reason=$(printf '%s\n' "$out" | sed -n 's/^berth: //p' | tail -n 1)
scontrol update nodename="${SLURMD_NODENAME:?}" state=drain reason="${reason:-berth epilog failed}" && exit 0
exit 1
