"""What machine a benchmark ran on, recorded in every results file, and the file written."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("numpy", "highspy", "PuLP")


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cpu_model": cpu_model or platform.processor(),
                            "python": platform.python_version(), "platform": platform.platform()}
    for package in PACKAGES:
        try:
            info[package.lower()] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return info


def write_results(out: Path, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``out`` (its folder made if missing), and a line on stderr saying so."""
    import sys

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
