"""What Linux says about this process's memory, for tests of huge-page placement."""
from __future__ import annotations

import sys
from pathlib import Path


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text.split("[")[1].split("]")[0]


def mapping_at(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry (header line and fields) of the mapping containing `address`."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if inside:
                break
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
            if inside:
                entry["range"] = line
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
    return entry


THP_ON = sys.platform.startswith("linux") and _thp_mode() in ("always", "madvise")
