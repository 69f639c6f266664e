"""Lists every equality check's count of compared steps from a pytest junit XML file, a line per
check, and exits 1 if any check compared none or under 90% of its steps (``make test`` runs it).

Usage: ``python tests/steps_report.py build/junit.xml``
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FLOOR = 0.9  # tests/steps_compared.FLOOR; this script runs with no package on its path
LINE = re.compile(r"compared (\d+)/(\d+) (.+)")


def checks(junit: Path) -> list[tuple[str, int, int, str]]:
    """(test id, compared, total, what) for each count a test recorded."""
    found = []
    for case in ET.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        for prop in case.iter("property"):
            if prop.get("name") == "steps_compared" and (m := LINE.fullmatch(prop.get("value", ""))):
                found.append((test, int(m[1]), int(m[2]), m[3]))
    return found


def main(junit: Path) -> int:
    found = checks(junit)
    low = [c for c in found if c[2] == 0 or c[1] < FLOOR * c[2]]
    for test, compared, total, what in sorted(found):
        print(f"{compared / max(total, 1):6.1%}  {compared:>4}/{total:<4} {what:<14} {test}")
    tests = len({c[0] for c in found})
    print(f"{len(found)} checks in {tests} tests; {len(low)} under {FLOOR:.0%}")
    return 1 if low or not found else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
