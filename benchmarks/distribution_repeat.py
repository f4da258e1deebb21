"""Repeat the engine sampling-distribution test to tell a false alarm from a bug.

Runs the tiny distribution pair's test (tests/test_engine_distribution_pair.py) ``--rounds``
times with both engines up: each round the USD engine first serves the fixture's greedy and
mixed batches (as in the test), then both engines draw N two-token completions per setting.
Prints each round's p-value, every cross pair's, and the pooled test on rounds x N per side.
Under the null the p-values are uniform; a bug gives small ones round after round and a tiny
pooled p.

    .venv/bin/python benchmarks/distribution_repeat.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from tests import test_engine_distribution_pair as t
    from tests.engines import engine
    from tests.fixtures import tiny
    from tests.stats import homogeneity_pvalue

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    target, drafter = tiny.build_distribution_pair()
    base: dict[str, list] = {s: [] for s in t.SETTINGS}
    usd: dict[str, list] = {s: [] for s in t.SETTINGS}
    with engine(target, max_num_seqs=256) as alone, \
            engine(target, drafter=drafter, k=3, max_num_seqs=256) as with_usd:
        for r in range(args.rounds):
            t._greedy(with_usd), t._mixed(with_usd), t._mixed(with_usd)
            for s in t.SETTINGS:
                usd[s].append(t._samples(with_usd, s))
                base[s].append(t._samples(alone, s))
            print(json.dumps({"round": r, **{s: homogeneity_pvalue(base[s][-1], usd[s][-1]) for s in t.SETTINGS}}),
                  flush=True)
    result = {"command": "python benchmarks/distribution_repeat.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "n_per_round": t.N_SAMPLES, "settings": {}}
    for s in t.SETTINGS:
        result["settings"][s] = {
            "per_round": [homogeneity_pvalue(a, b) for a, b in zip(base[s], usd[s])],
            "cross": [homogeneity_pvalue(a, b) for a in base[s] for b in usd[s]],
            "pooled": homogeneity_pvalue(sum(base[s], []), sum(usd[s], [])),
        }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
