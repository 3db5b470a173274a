"""Write a ratings file from a planted low-rank model (MovieLens '::' format).

    .venv/bin/python scripts/make_ratings.py data/ratings.dat [--users 500 --items 300 --ratings 40000]

Rating = clip(round(3.5 + u.v + b_u + b_i + noise), 1, 5); lines are shuffled.
"""

import argparse
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--users", type=int, default=500)
    ap.add_argument("--items", type=int, default=300)
    ap.add_argument("--ratings", type=int, default=40000)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    U = rng.normal(0, 0.6, (a.users, a.rank))
    V = rng.normal(0, 0.6, (a.items, a.rank))
    bu, bi = rng.normal(0, 0.3, a.users), rng.normal(0, 0.3, a.items)
    u = rng.integers(0, a.users, a.ratings)
    i = rng.zipf(1.3, a.ratings) % a.items
    r = np.clip(np.round(3.5 + (U[u] * V[i]).sum(1) + bu[u] + bi[i] + rng.normal(0, 0.3, a.ratings)), 1, 5)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for k in range(a.ratings):
            f.write(f"{u[k] + 1}::{i[k] + 1}::{int(r[k])}::{978300000 + k}\n")
    print(f"wrote {a.ratings} ratings of {a.users} users x {a.items} items to {a.out}")


if __name__ == "__main__":
    main()
