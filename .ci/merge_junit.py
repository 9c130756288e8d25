"""Merge the junit files of one leg's pytest runs into one (``<testsuites>``), for the matrix
table and the failure listing.

    python3 .ci/merge_junit.py OUT IN [IN ...]     (an IN that does not exist is skipped)
"""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(out: str, inputs: list[str]) -> int:
    merged = ET.Element("testsuites")
    for path in map(Path, inputs):
        if not path.exists():
            continue
        root = ET.parse(path).getroot()
        merged.extend([root] if root.tag == "testsuite" else root.iter("testsuite"))
    if not len(merged):
        print(f"merge_junit: none of {inputs} exists", file=sys.stderr)
        return 1
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
