#!/usr/bin/env bash
# Install Debian's Chromium, which the dashboard's browser tests (tests/test_dashboard.py) drive through
# Playwright: Playwright's own browser download cannot be reached from these machines. Idempotent and
# quiet: does nothing when /usr/bin/chromium is already there (run as root to install it).
set -euo pipefail

CHROMIUM=/usr/bin/chromium
[ -x "$CHROMIUM" ] && exit 0

die() { echo "install_browser.sh: $*" >&2; exit 1; }

command -v apt-get >/dev/null 2>&1 || die "$CHROMIUM missing and apt-get not found; install Chromium by hand"
[ "$(id -u)" -eq 0 ] || die "$CHROMIUM missing; run as root to install it with apt-get"

export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
trap 'rm -f "$log"' EXIT

if ! apt-get install -y -q chromium >"$log" 2>&1; then
    # Most likely a stale or empty package index: refresh it once and retry.
    if ! { apt-get update -q && apt-get install -y -q chromium; } >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        die "apt-get install chromium failed (output above)"
    fi
fi

[ -x "$CHROMIUM" ] || die "installed chromium but $CHROMIUM is still missing"
