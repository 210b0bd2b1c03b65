"""Merge the JSON of every bench step of a GPU script into one file (rows in step order).

    python3 tools/merge_bench_rows.py ROWS_DIR OUT.json

Each step's file is ROWS_DIR/step<k>-<tag><nproc>.json (`bench_step` in tools/gpu_env.sh); every
row gets `<tag>: <nproc>` (e.g. cp: 2, ep: 2), so the merged file says how each row ran.
"""

import glob
import json
import os
import re
import sys


def main(rows_dir: str, out: str) -> None:
    rows, first = [], None
    paths = glob.glob(os.path.join(rows_dir, "step*.json"))
    for path in sorted(paths, key=lambda p: int(re.search(r"step(\d+)", os.path.basename(p)).group(1))):
        data = json.load(open(path))
        first = first or data
        tag, nproc = re.search(r"step\d+-([a-z]+)(\d+)\.json$", os.path.basename(path)).groups()
        rows += [dict(row, **{tag: int(nproc)}) for row in data["rows"]]
    json.dump(dict(first or {}, rows=rows), open(out, "w"), indent=2)
    print(f"{len(rows)} rows merged into {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
