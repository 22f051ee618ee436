"""The README's table from the test command's JUnit files: torch version x tier -> passed / failed, op sweep."""

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

__all__ = ["main", "tally"]

TIERS = ("unit", "ranks", "transport", "notebooks", "notebooks (engines)")


def _tier(case: ET.Element, engines: bool) -> str:
    where = (case.get("classname") or "") + "/" + (case.get("file") or "")  # not the name: a test may say "notebooks"
    for tier in ("unit", "ranks", "transport"):
        if f"tests.{tier}." in where or f"tests/{tier}/" in where:
            return tier
    if "notebooks" in where or ".ipynb" in where:
        return "notebooks (engines)" if engines else "notebooks"
    return "other"


def tally(path: str) -> tuple[dict, list]:
    """tier -> Counter(passed, failed, skipped); the op sweep's figures recorded in the file."""
    engines = "engines" in path
    per: dict = {}
    sweeps = []
    for case in ET.parse(path).getroot().iter("testcase"):
        c = per.setdefault(_tier(case, engines), Counter())
        if case.find("failure") is not None or case.find("error") is not None:
            c["failed"] += 1
        elif case.find("skipped") is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
        for prop in case.iter("property"):
            if prop.get("name") == "op_sweep":
                sweeps.append(prop.get("value"))
    return per, sweeps


def _sweep(found: list) -> str:
    """The op sweep's runs summed: cases tried, wrong, crashed."""
    total = Counter()
    for text in found:
        for n, what in re.findall(r"(\d+) (cases tried|wrong|crashed)", text):
            total[what] += int(n)
    if not found:
        return "not run"
    return f"{total['cases tried']:,} cases, {total['wrong']} wrong, {total['crashed']} crashed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+", help="JUnit files named torch-VERSION[-engines].xml")
    a = ap.parse_args(argv)
    rows: dict = {}
    sweeps: dict = {}
    free = None  # the torch-free tests, run once with torch blocked (torch-free.xml)
    for path in a.files:
        if path.endswith("torch-free.xml"):
            free = sum(tally(path)[0].values(), Counter())
            continue
        m = re.search(r"torch-(\d+(?:\.\d+)*)", path)
        version = m.group(1) if m else path
        per, sw = tally(path)
        rows.setdefault(version, {}).update(per)
        sweeps.setdefault(version, []).extend(sw)
    tiers = [t for t in TIERS + ("other",) if any(t in r for r in rows.values())]
    print("| torch | " + " | ".join(tiers) + " | op sweep |")
    print("|---" * (len(tiers) + 2) + "|")
    bad = 0
    for version in sorted(rows, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit())):
        cells = []
        for t in tiers:
            c = rows[version].get(t)
            if c is None:
                cells.append("not run")
                continue
            bad += c["failed"]
            text = f"{c['passed']} passed" + (f", {c['failed']} failed" if c["failed"] else "")
            cells.append(text + (f", {c['skipped']} skipped" if c["skipped"] else ""))
        sweep = _sweep(sweeps[version])
        print(f"| {version} | " + " | ".join(cells) + f" | {sweep} |")
    if free is not None:
        bad += free["failed"]
        print(f"\nand once, torch blocked (the unit tier's torch-free tests): {free['passed']} passed"
              + (f", {free['failed']} failed" if free["failed"] else "")
              + (f", {free['skipped']} skipped" if free["skipped"] else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
