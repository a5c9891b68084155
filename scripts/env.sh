# Sourced by scripts/demo and scripts/test: make (or reuse) the project's .venv.
# Reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
if [ ! -x "$root/.venv/bin/python" ]; then
    "$py" -m venv "$root/.venv"
fi
stamp="$root/.venv/.themis-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$root/.venv/bin/python" -m pip install --quiet --upgrade pip >&2
    # setuptools' notice on every editable install of a flat layout is informational; silenced so a
    # clean install prints nothing (issue 11 item 6). Real errors still fail the script.
    PYTHONWARNINGS=ignore "$root/.venv/bin/python" -m pip install --quiet -e "$root[test]" >&2
    echo "$want" > "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
cd "$root"
