"""Writes `workers/tasks/data/math_word.jsonl`: the `math_word` task's sample of short word problems.

`python -m workers.tasks.make_math_word` writes the file again, byte for byte the same: the problems
come from a seeded generator (a test checks the committed file is its output). Each row is
`{"prompt": "...", "answer": "19"}`: one step of addition, subtraction, multiplication or exact
division over small numbers, answers integers from 0 to 100.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from workers.tasks.registry import DATA_DIR

ROWS = 200
SEED = 19

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eva", "Finn", "Gus", "Ivy", "Jo", "Kim", "Leo", "Max", "Nia", "Raj", "Sam", "Tia"]
ITEMS = ["apples", "pens", "cards", "eggs", "shells", "books", "coins", "cups", "beads", "stamps"]


def problem(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        return f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b
    if kind == 1:
        a = rng.randint(10, 90)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item} and gave away {b}. How many are left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"{name} buys {a} bags of {b} {item}. How many {item} in all?", a * b
    if kind == 3:
        b, each = rng.randint(2, 8), rng.randint(2, 12)
        return f"{name} shares {b * each} {item} among {b} friends. How many does each get?", each
    a, b, c = rng.randint(5, 40), rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item}, finds {b}, then loses {c}. How many now?", a + b - c


def rows(count: int = ROWS, seed: int = SEED) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        prompt, answer = problem(rng)
        if answer >= 0:
            out.append({"prompt": prompt, "answer": str(answer)})
    return out


def text(count: int = ROWS, seed: int = SEED) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(count, seed))


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else DATA_DIR / "math_word.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text(), encoding="utf-8")
    print(f"wrote {ROWS} problems to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
