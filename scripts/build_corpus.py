#!/usr/bin/env python3
"""Generate the shipped offline training corpus (dtrain/assets/corpus/*.txt).

The sandbox and the tests train without network, so dtrain ships its own text.
This script writes varied English-like prose from a small hand-written grammar,
one paragraph per line, split into several files so that the streaming loader
sees several shards. Output is a pure function of --seed: running it again gives
byte-identical files (tests check this against the shipped copy).

    python scripts/build_corpus.py            # rewrite dtrain/assets/corpus
    python scripts/build_corpus.py --check    # exit 1 if the shipped files differ
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "dtrain" / "assets" / "corpus"

TOWNS = ["Ashford", "Bramley", "Carrow", "Dunmere", "Elston", "Fairholm", "Glenby", "Harrowgate",
         "Ivybridge", "Kelmscott", "Larkhill", "Marlow", "Northwick", "Oakham", "Penrith", "Quarry Bay",
         "Redhaven", "Stoneleigh", "Thornbury", "Upwell", "Westmere", "Yarrow"]
RIVERS = ["Avel", "Brenn", "Calder", "Dove", "Esk", "Frome", "Lune", "Severn", "Tamar", "Wye"]
PEOPLE = ["Ada", "Bram", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Iris", "Jonas", "Kaya",
          "Leon", "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tomas", "Una", "Viktor",
          "Wren", "Yusuf", "Zora"]
SURNAMES = ["Abbott", "Baker", "Carter", "Dawson", "Ellis", "Fletcher", "Grant", "Hale", "Irwin",
            "Keller", "Lowe", "Mercer", "Novak", "Osei", "Price", "Reyes", "Sato", "Turner", "Vance", "Weber"]
JOBS = ["baker", "carpenter", "teacher", "engineer", "nurse", "farmer", "librarian", "pilot", "chemist",
        "painter", "miller", "fisher", "surveyor", "clockmaker", "gardener", "printer"]
ANIMALS = ["fox", "heron", "badger", "otter", "owl", "hare", "wolf", "deer", "swallow", "beaver",
           "falcon", "salmon", "lynx", "crow", "tortoise"]
FOODS = ["bread", "apples", "cheese", "barley", "honey", "plums", "beans", "oats", "cabbages", "pears",
         "salted fish", "walnuts", "onions", "cider"]
GOODS = ["wool", "timber", "copper", "salt", "glass", "paper", "linen", "tin", "leather", "coal"]
COLOURS = ["red", "grey", "green", "pale", "dark", "golden", "blue", "white", "amber", "silver"]
WEATHER = ["rain", "snow", "fog", "wind", "sunshine", "hail", "frost", "thunder"]
SEASONS = ["spring", "summer", "autumn", "winter"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ADJ = ["quiet", "busy", "old", "narrow", "wide", "steep", "bright", "cold", "warm", "crowded", "empty",
       "famous", "small", "ancient", "modern", "windy"]
PLACES = ["market", "harbour", "bridge", "library", "mill", "square", "station", "chapel", "school",
          "orchard", "forge", "lighthouse", "garden", "museum", "workshop"]
VERBS_PAST = ["visited", "repaired", "painted", "measured", "described", "studied", "crossed",
              "photographed", "cleaned", "rebuilt", "mapped", "guarded"]
SCIENCE = [("water", "boils at one hundred degrees at sea level"),
           ("light", "travels faster than sound"),
           ("iron", "rusts when it meets water and air"),
           ("the moon", "pulls the tides of the sea"),
           ("plants", "turn sunlight into sugar"),
           ("ice", "floats because it is lighter than water"),
           ("copper", "carries electricity well"),
           ("sound", "moves more quickly through water than through air"),
           ("a magnet", "points towards the north"),
           ("warm air", "rises above cold air")]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]


def person(r: random.Random) -> str:
    return f"{r.choice(PEOPLE)} {r.choice(SURNAMES)}"


def s_town(r: random.Random) -> str:
    t = r.choice(TOWNS)
    return r.choice([
        f"{t} is a {r.choice(ADJ)} town on the river {r.choice(RIVERS)}.",
        f"The {r.choice(PLACES)} in {t} was built in {r.randint(1450, 1950)}.",
        f"Most people in {t} work as {r.choice(JOBS)}s or trade in {r.choice(GOODS)}.",
        f"In {r.choice(SEASONS)} the streets of {t} are {r.choice(ADJ)} and full of {r.choice(FOODS)} sellers.",
        f"About {r.randint(2, 90) * 100} people live in {t}, and the {r.choice(PLACES)} is the heart of it.",
        f"The road from {t} to {r.choice(TOWNS)} is {r.randint(3, 60)} miles long.",
    ])


def s_story(r: random.Random) -> str:
    p, q = person(r), r.choice(PEOPLE)
    return r.choice([
        f"{p} was a {r.choice(JOBS)} who lived near the {r.choice(PLACES)}.",
        f"One {r.choice(DAYS)} morning {q} {r.choice(VERBS_PAST)} the {r.choice(ADJ)} {r.choice(PLACES)}.",
        f"\"We should leave before the {r.choice(WEATHER)},\" said {q}, looking at the {r.choice(COLOURS)} sky.",
        f"{q} carried a basket of {r.choice(FOODS)} to the {r.choice(PLACES)} and sold it by noon.",
        f"When the {r.choice(ANIMALS)} appeared at the edge of the {r.choice(PLACES)}, {q} stood very still.",
        f"{p} wrote a letter to {r.choice(PEOPLE)} about the {r.choice(WEATHER)} in {r.choice(MONTHS)}.",
        f"After a long day, {q} sat by the fire and counted {r.choice(NUMBER_WORDS)} coins.",
    ])


def s_nature(r: random.Random) -> str:
    a = r.choice(ANIMALS)
    return r.choice([
        f"The {a} hunts at {r.choice(['dawn', 'dusk', 'night', 'noon'])} and rests in the {r.choice(['reeds', 'woods', 'hills', 'fields'])}.",
        f"A {r.choice(COLOURS)} {a} can often be seen near the river {r.choice(RIVERS)} in {r.choice(SEASONS)}.",
        f"In {r.choice(MONTHS)} the {a}s gather in groups of {r.choice(NUMBER_WORDS)} or more.",
        f"The {a} is {r.choice(['shy', 'clever', 'patient', 'quick', 'careful'])}, and it rarely comes close to people.",
        f"Heavy {r.choice(WEATHER)} in {r.choice(SEASONS)} makes life hard for the {a}.",
    ])


def s_science(r: random.Random) -> str:
    thing, fact = r.choice(SCIENCE)
    return r.choice([
        f"It is well known that {thing} {fact}.",
        f"A simple experiment shows that {thing} {fact}.",
        f"Children learn at school that {thing} {fact}.",
        f"Because {thing} {fact}, engineers must plan with care.",
    ])


def s_numbers(r: random.Random) -> str:
    a, b = r.randint(2, 40), r.randint(2, 40)
    return r.choice([
        f"If you add {a} and {b} you get {a + b}.",
        f"{a} times {b} is {a * b}.",
        f"The difference between {max(a, b)} and {min(a, b)} is {max(a, b) - min(a, b)}.",
        f"A crate holds {a} jars, so {b} crates hold {a * b} jars.",
        f"The journey took {a} hours and {b % 60} minutes.",
    ])


def s_trade(r: random.Random) -> str:
    g, t = r.choice(GOODS), r.choice(TOWNS)
    return r.choice([
        f"Merchants from {t} bought {g} at {r.randint(2, 99)} shillings a load.",
        f"The price of {g} rose in {r.choice(MONTHS)} after the {r.choice(WEATHER)} closed the roads.",
        f"Ships from {r.choice(TOWNS)} brought {g} and {r.choice(FOODS)} to the harbour of {t}.",
        f"Trade in {g} made {t} {r.choice(['rich', 'famous', 'busy', 'crowded'])} for a hundred years.",
    ])


KINDS = [s_town, s_story, s_nature, s_science, s_numbers, s_trade]


def paragraph(r: random.Random) -> str:
    # A paragraph keeps to one or two topics so that there is structure to learn.
    topics = r.sample(KINDS, k=r.choice([1, 2, 2, 3]))
    return " ".join(r.choice(topics)(r) for _ in range(r.randint(3, 8)))


def build(seed: int, files: int, bytes_per_file: int) -> dict[str, bytes]:
    r = random.Random(seed)
    out = {}
    for i in range(files):
        lines, size = [], 0
        while size < bytes_per_file:
            line = paragraph(r)
            lines.append(line)
            size += len(line) + 1
        out[f"part-{i:03d}.txt"] = ("\n".join(lines) + "\n").encode("utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--bytes-per-file", type=int, default=320_000)
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = ap.parse_args(argv)
    files = build(args.seed, args.files, args.bytes_per_file)
    if args.check:
        bad = [n for n, b in files.items() if not (args.out / n).is_file() or (args.out / n).read_bytes() != b]
        if bad:
            print(f"corpus differs from generator output: {', '.join(bad)}", file=sys.stderr)
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values()))} bytes to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
