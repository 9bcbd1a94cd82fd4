#!/bin/sh
# Slurm Prolog for berth: runs `berth prolog`, which reads the job from Slurm's environment
# (SLURM_JOB_ID, SLURM_JOB_UID, …, and SPANK_BERTH_IMAGE set by the SPANK plugin).
# Slurm runs it as root with no PATH at all; this wrapper sets one for berth and what it runs.
# Install as in configs/slurm/README.md: slurm.conf Prolog=/etc/slurm/berth-prolog.sh
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# The berth binary, and arguments before the verb (e.g. BERTH_ARGS="--config /etc/berth/berth.toml").
BERTH=/usr/local/bin/berth
BERTH_ARGS=
# shellcheck disable=SC2086 # BERTH_ARGS holds several words on purpose
exec "$BERTH" $BERTH_ARGS prolog
