#!/usr/bin/env python3
"""Derive placement slowdowns (mechanism D1) from Gavel's measured throughputs.

For a model and GPU type, every (batch size, GPU count > 1) pair measured both consolidated (one
machine) and unconsolidated (spread across machines) gives a ratio consolidated / spread; the
level-2 slowdown (one rack, several machines) is the median ratio, at least 1. Gavel has no rack
level, so the level-3 (across racks) slowdown extends the extra slowdown by CROSS_RACK_FACTOR, the
mean ratio (S_rack - 1) / (S_machine - 1) in the Themis authors' simulator profiles (vgg16 2.37,
vgg19 2.33, alexnet 2.25, resnet101 2.04; see agent/profiles/slowdowns.toml). Levels 0 and 1 are 1.

    python scripts/derive_slowdowns.py [--gpu-type p100]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "profiles" / "gavel-simulation-throughputs.json"
GAVEL_MODELS = {"lm": "LM", "resnet50": "ResNet-50", "transformer": "Transformer"}
CROSS_RACK_FACTOR = 2.25
_KEY = re.compile(r"\('(?P<model>.+) \(batch size (?P<bs>\d+)\)', (?P<n>\d+)\)")


def derive(gpu_type: str = "p100", data: Path = DATA) -> dict[str, tuple[float, float, float, float]]:
    table = json.loads(data.read_text())
    together, spread = table[gpu_type], table[f"{gpu_type}_unconsolidated"]
    ratios: dict[str, list[float]] = {}
    for key, entry in together.items():
        m = _KEY.fullmatch(key)
        if not m or int(m["n"]) < 2 or key not in spread:
            continue
        ratios.setdefault(m["model"], []).append(entry["null"] / spread[key]["null"])
    out = {}
    for name, gavel_name in GAVEL_MODELS.items():
        s2 = round(max(1.0, statistics.median(ratios[gavel_name])), 3)
        s3 = round(1.0 + (s2 - 1.0) * CROSS_RACK_FACTOR, 3)
        out[name] = (1.0, 1.0, s2, s3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-type", default="p100", choices=["k80", "p100", "v100"])
    args = parser.parse_args()
    for name, s in derive(args.gpu_type).items():
        print(f"{name}: slowdown = {list(s)}")


if __name__ == "__main__":
    main()
