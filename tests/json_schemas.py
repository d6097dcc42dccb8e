"""Random JSON schemas for the tests of structured output: nested objects with required and optional fields,
arrays with minItems/maxItems, enums, integers and numbers with ranges, strings bounded by maxLength or by a
pattern, booleans. Every instance is short (bounded strings, arrays and ranges), so that a sampled output ends
well within a tiny model's sequence."""

from __future__ import annotations

import random

PATTERNS = [r"^[a-z]{1,6}$", r"^[0-9]{3}-[A-Z]{2}$", r"^(ka|lo|mi){1,3}$", r"^[A-Z][a-z]{0,4}$", r"^#[0-9a-f]{6}$",
            r"^(yes|no)$"]
WORDS = ["kalo", "mine", "ru sta", "zo", "pri-gu", "Tha", "été", "x"]
KEYS = ["name", "count", "tags", "id", "size", "kind", "ok", "price", "items", "note", "level", "meta"]


def random_schema(seed: int, max_depth: int = 2) -> dict:
    """A schema of an object at the top, its fields drawn at random (``seed``), nested ``max_depth`` deep."""
    return _object(random.Random(seed), max_depth, top=True)


def _object(rng: random.Random, depth: int, top: bool = False) -> dict:
    keys = rng.sample(KEYS, rng.randint(1, 3 if top else 2))
    properties = {k: _value(rng, depth - 1) for k in keys}
    required = [k for k in keys if rng.random() < 0.6]
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean"]
    if depth > 0:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([0, 1, 9, 100])}
    if kind == "number":
        low = round(rng.uniform(-10, 10), 1)
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([0.5, 1, 20])}
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(1, 6)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        options = rng.sample(WORDS, rng.randint(1, 4)) + rng.sample([0, 1, 42, -3], rng.randint(0, 2))
        return {"enum": options}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "object":
        return _object(rng, depth)
    low = rng.randint(0, 2)
    return {"type": "array", "items": _value(rng, depth - 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
