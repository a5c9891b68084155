#!/usr/bin/env bash
# Install the Slurm + MUNGE packages that tests/slurm_kit.py needs (Debian/Ubuntu, run as root).
# Idempotent and quiet: does nothing when slurmctld, slurmd, sbatch and munged are already on PATH.
set -euo pipefail

# The daemons live in /usr/sbin, which a non-login PATH may lack.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

have_all() {
    local tool
    for tool in slurmctld slurmd sbatch munged; do
        command -v "$tool" >/dev/null 2>&1 || return 1
    done
}

have_all && exit 0

die() { echo "install_slurm.sh: $*" >&2; exit 1; }

command -v apt-get >/dev/null 2>&1 || die "slurmctld/slurmd/sbatch/munged missing and apt-get not found; install Slurm and MUNGE by hand"
[ "$(id -u)" -eq 0 ] || die "slurmctld/slurmd/sbatch/munged missing; run as root to install them with apt-get"

export DEBIAN_FRONTEND=noninteractive
packages=(slurmctld slurmd slurm-client munge)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

if ! apt-get install -y -q "${packages[@]}" >"$log" 2>&1; then
    # Most likely a stale or empty package index: refresh it once and retry.
    if ! { apt-get update -q && apt-get install -y -q "${packages[@]}"; } >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "apt-get install ${packages[*]} failed (output above)"
    fi
fi

have_all || die "installed ${packages[*]} but slurmctld/slurmd/sbatch/munged are still not on PATH"
