"""A synthetic English corpus generated from a seed: the embedded default needs text to train its
tokenizer and to fine-tune on, and nothing may be downloaded. Short templated sentences about people,
places and work, varied enough that a small LM has something to learn."""

from __future__ import annotations

import numpy as np

NAMES = ("Alice Bob Carol David Erin Frank Grace Heidi Ivan Judy Karl Laura Mallory Nina Oscar Peggy "
         "Quentin Rupert Sybil Trent Ursula Victor Wendy Xavier Yvonne Zoe").split()
CITIES = ("Paris London Berlin Madrid Rome Vienna Prague Lisbon Dublin Oslo Warsaw Athens Zurich Milan "
          "Boston Denver Austin Seattle Toronto Sydney").split()
JOBS = ("baker teacher nurse pilot farmer writer doctor painter lawyer chef engineer driver singer "
        "tailor carpenter librarian").split()
THINGS = ("bread books flowers coffee music bicycles maps letters tea apples boats lamps clocks "
          "shoes paintings gardens").split()
ADJECTIVES = "small quiet busy old new bright warm cold large famous friendly distant".split()
TEMPLATES = (
    "{name} lives in {city} and works as a {job}.",
    "Every morning {name} buys {thing} in a {adj} shop in {city}.",
    "The {job} from {city} likes {thing} more than anything.",
    "{name} and {name2} met in {city} while looking for {thing}.",
    "In {city} the {adj} streets are full of {thing}.",
    "{name} wants to become a {job} and move to {city}.",
    "Last year {name} sold {thing} to a {job} in {city}.",
    "A {adj} {job} named {name} teaches children about {thing}.",
)


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    pick = lambda words: words[rng.integers(len(words))]  # noqa: E731
    return [TEMPLATES[rng.integers(len(TEMPLATES))].format(
        name=pick(NAMES), name2=pick(NAMES), city=pick(CITIES), job=pick(JOBS), thing=pick(THINGS),
        adj=pick(ADJECTIVES)) for _ in range(n)]
