"""GSM8K-style arithmetic word problems as a messages JSONL, for by-hand checks on a small real model.

    python bench/arith_problems.py --out-dir /work/ckpt/arith [--train 400 --test 80 --seed 0] [--instruction verl]

No real GSM8K is reachable offline (PyPI's aviary.gsm8k ships only code that downloads it), and real
GSM8K is out of reach of a 135M model anyway (SmolLM2-135M-Instruct scores ~1-2% on it), which would
make "the held-out reward does not fall" say nothing. These are easier problems in GSM8K's format:
one operation (+, -, x, /; the default) or, with --two-ops F, a fraction F of two (+ then -, x then +);
operands of + and - up to --max (default 10), of x and / up to half of it. One line per problem:

    {"question": [{"role": "user", "content": "Tom has 5 apples. He buys 11 more. ..."}],
     "solution": "Tom has 5 + 11 = <<5+11=16>>16 apples.\\n#### 16"}

train.jsonl and test.jsonl (held out: no question text in both). Use with data.prompt_field=question
data.answer_field=solution (the math_answer reward takes the number after "####").
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = [
    ("Tom", "He"),
    ("Anna", "She"),
    ("Ravi", "He"),
    ("Maria", "She"),
    ("Ken", "He"),
    ("Lena", "She"),
    ("Omar", "He"),
    ("Sara", "She"),
    ("Ben", "He"),
    ("Mia", "She"),
]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "stamps", "shells", "coins"]
BOXES = [("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("basket", "baskets"), ("pack", "packs")]


def _one(r: random.Random, hi: int) -> tuple[str, str, int]:
    (name, he), item, (box, boxes) = r.choice(NAMES), r.choice(ITEMS), r.choice(BOXES)
    kind = r.choice(["add", "sub", "mul", "div"])
    if kind == "add":
        a, b = r.randint(2, hi), r.randint(2, hi)
        q = f"{name} has {a} {item}. {he} buys {b} more. How many {item} does {name} have now?"
        return q, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.", a + b
    if kind == "sub":
        a = r.randint(5, max(hi, 6))
        b = r.randint(2, a - 2)
        q = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?"
        return q, f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left.", a - b
    if kind == "mul":
        a, b = r.randint(2, max(2, hi // 2)), r.randint(2, max(2, hi // 2))
        q = f"A {box} holds {a} {item}. How many {item} are in {b} {boxes}?"
        return q, f"{b} {boxes} hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.", a * b
    b, c = r.randint(2, max(2, hi // 2)), r.randint(2, max(2, hi // 2))
    a = b * c
    q = f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"
    return q, f"Each friend gets {a} / {b} = <<{a}/{b}={c}>>{c} {item}.", c


def _two(r: random.Random, hi: int) -> tuple[str, str, int]:
    (name, he), item, (box, boxes) = r.choice(NAMES), r.choice(ITEMS), r.choice(BOXES)
    if r.random() < 0.5:
        a, b = r.randint(2, hi), r.randint(2, hi)
        c = r.randint(1, a + b - 1)
        q = f"{name} has {a} {item}. {he} buys {b} more and then gives away {c}. "
        q += f"How many {item} does {name} have now?"
        s = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
        s += f"Then {a + b} - {c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} {item}."
        return q, s, a + b - c
    a, b, c = r.randint(2, max(2, hi // 2)), r.randint(2, max(2, hi // 2)), r.randint(1, hi)
    q = (
        f"{name} buys {b} {boxes} with {a} {item} in each {box}. {he} already had {c} {item}. "
        f"How many {item} does {name} have now?"
    )
    s = f"The {boxes} hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n"
    s += f"With the others: {a * b} + {c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} {item}."
    return q, s, a * b + c


VERL_GSM8K = 'Let\'s think step by step and output the final answer after "####".'


def problems(n: int, r: random.Random, seen: set[str], two_ops: float, hi: int, instruction: str = "") -> list[dict]:
    out = []
    while len(out) < n:
        q, s, ans = (_two if r.random() < two_ops else _one)(r, hi)
        if q in seen:
            continue
        seen.add(q)
        content = f"{q} {instruction}" if instruction else q
        out.append({"question": [{"role": "user", "content": content}], "solution": f"{s}\n#### {ans}"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--test", type=int, default=80)
    ap.add_argument("--two-ops", type=float, default=0.0, help="fraction of two-operation problems")
    ap.add_argument("--max", type=int, default=10, help="largest operand of + and - (x and / use up to half)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--instruction",
        default="",
        help=f"appended to each question ('verl': verl's GSM8K preprocessing's {VERL_GSM8K!r}); "
        "session 25-27's held-out numbers used none",
    )
    args = ap.parse_args()
    if args.instruction == "verl":
        args.instruction = VERL_GSM8K
    r, seen = random.Random(args.seed), set()
    test = problems(args.test, r, seen, args.two_ops, args.max, args.instruction)  # drawn first: never in train
    train = problems(args.train, r, seen, args.two_ops, args.max, args.instruction)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(os.path.join(args.out_dir, f"{name}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{args.out_dir}/{name}.jsonl: {len(rows)} problems")


if __name__ == "__main__":
    main()
