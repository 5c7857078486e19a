"""A benchmark of this repository run on two trees side by side: an earlier commit ("before") and
the working tree ("after"), rounds interleaved (before, after, before, after, ...) so that the
machine's drift falls on both; per record the median of each side and the after/before ratio.

    python bench/ab_trees.py --before c62205b^ --rounds 2 -- bench/rl_step.py --workloads R1-a,R2
    python bench/ab_trees.py --before c62205b^ --metric new_tokens_per_s -- bench/generate.py --no-naive

The command after `--` is a script of bench/ that writes its records (a JSON list of dicts) where
`--json PATH` says; it runs with each tree's own code (cwd and PYTHONPATH that tree) and this
checkout's Python. The before tree is `git archive` of the commit, extracted once under /tmp.
Records are matched on their `workload` and `variant`; `--metric` (default seconds_per_step) is
compared: for a time, a ratio below 1 means the after tree is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def before_tree(commit: str) -> str:
    """A clean copy of `commit` (cached by its full hash)."""
    sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", commit], text=True).strip()
    path = os.path.join(tempfile.gettempdir(), f"rpeg_ab_{sha[:12]}")
    if not os.path.isdir(path):
        tmp = path + ".part"
        os.makedirs(tmp, exist_ok=True)
        archive = subprocess.run(["git", "-C", ROOT, "archive", sha], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        os.rename(tmp, path)
    return path


def run(tree: str, cmd: list[str], out: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run([sys.executable, *cmd, "--json", out], cwd=tree, env=env, check=True)
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=2, help="before/after pairs, interleaved")
    ap.add_argument("--metric", default="seconds_per_step", help="the record field compared")
    ap.add_argument("--json", help="write every round's records and the summary here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- bench/SCRIPT.py [its arguments]")
    args = ap.parse_args(argv)
    cmd = [c for c in args.command if c != "--"]
    if not cmd:
        ap.error("give the benchmark after --, e.g. -- bench/rl_step.py --workloads R2")
    trees = {"before": before_tree(args.before), "after": ROOT}
    got: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for side in ("before", "after"):
                print(f"== round {i + 1}/{args.rounds}: {side} ({trees[side]})", flush=True)
                got[side].append(run(trees[side], cmd, os.path.join(tmp, f"{side}{i}.json")))
    key = lambda r: (r.get("workload"), r.get("variant"))  # noqa: E731
    summary = []
    for k in sorted({key(r) for rs in got["after"] for r in rs}, key=str):
        vals = {s: [r[args.metric] for rs in got[s] for r in rs if key(r) == k and args.metric in r] for s in got}
        if not vals["before"] or not vals["after"]:
            continue
        b, a = statistics.median(vals["before"]), statistics.median(vals["after"])
        summary.append({"workload": k[0], "variant": k[1], "before": b, "after": a, "ratio": a / b, **vals})
        print(f"{k[0]!s:14s} {k[1]!s:12s} before {b:10.4g}  after {a:10.4g}  after/before {a / b:.3f}  {vals}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.before, "command": cmd, "summary": summary, "rounds": got}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
