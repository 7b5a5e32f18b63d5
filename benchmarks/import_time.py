"""Import cost of flashwatch, two trees side by side (issue 37): `import flashwatch`,
`python -m flashwatch.cli --help` and `import torch` alone, 5 runs each, alternating
the trees run by run, medians. BEFORE: a tree of the code before (git archive of the
commit into a directory, .pyc compiled), AFTER: the working tree.

    python -m compileall -q BEFORE/flashwatch flashwatch
    python benchmarks/import_time.py BEFORE
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
trees = {"before": sys.argv[1], "after": str(Path(__file__).resolve().parents[1])}
cmds = {"import flashwatch": [PY, "-c", "import flashwatch"],
        "python -m flashwatch.cli --help": [PY, "-m", "flashwatch.cli", "--help"],
        "import torch (reference)": [PY, "-c", "import torch"]}
env = dict(os.environ, OMP_NUM_THREADS="1")
res = {}
for name, cmd in cmds.items():
    for _ in range(5):
        for tree, path in trees.items():
            t = time.perf_counter()
            subprocess.run(cmd, cwd=path, env=env, check=True, capture_output=True)
            res.setdefault((name, tree), []).append(time.perf_counter() - t)
for (name, tree), v in res.items():
    print(f"{name:33s} {tree:7s} median {statistics.median(v):.2f} s  runs "
          + " ".join(f"{x:.2f}" for x in v))
