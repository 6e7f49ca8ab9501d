"""Does an output follow its JSON schema? A validator for the subset of JSON Schema that the
``extract`` prompt set uses, and the per-method figures a run reports on schema-constrained output.

The subset: ``type`` (``object``, ``array``, ``string``, ``number``, ``integer``, ``boolean``,
``null``, or a list of them), ``properties``, ``required``, ``additionalProperties`` (``false`` or a
schema), ``items``, ``enum``, ``const``, ``minLength`` / ``maxLength`` (in code points),
``minItems`` / ``maxItems``, ``minimum`` / ``maximum``, and the annotations ``title`` and
``description``. :func:`check_schema` refuses any other keyword, so a schema is never judged by
rules this module does not know. Strings are counted in code points, as JSON Schema counts them;
``true`` and ``false`` are not numbers, and an integer is a number with no fractional part
(``2.0`` is one), as JSON Schema has it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "minLength", "maxLength",
    "minItems", "maxItems", "minimum", "maximum", "title", "description",
})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


def check_schema(schema: Any, path: str = "$") -> None:
    """Raise ``ValueError`` naming the place where ``schema`` leaves the subset this module validates."""
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a schema must be an object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - KEYWORDS)
    if unknown:
        raise ValueError(f"{path}: keyword {unknown[0]!r} is outside the validated subset")
    types = schema.get("type")
    for name in [types] if isinstance(types, str) else types or []:
        if name not in TYPES:
            raise ValueError(f"{path}: unknown type {name!r}")
    properties = schema.get("properties", {})
    for key, sub in properties.items():
        check_schema(sub, f"{path}.{key}")
    missing = [key for key in schema.get("required", []) if key not in properties]
    if missing:
        raise ValueError(f"{path}: required property {missing[0]!r} is not among the properties")
    extra = schema.get("additionalProperties", True)
    if extra is not True and extra is not False:
        check_schema(extra, f"{path}.*")
    if "items" in schema:
        check_schema(schema["items"], f"{path}[]")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise ValueError(f"{path}: enum must be a non-empty list")


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return number and (name == "number" or float(value).is_integer())


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b or (_is_type(a, "number") and _is_type(b, "number") and a == b)


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (one message per broken rule, naming the place); [] if it follows it."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, name) for name in names):
            return [f"{path}: expected {' or '.join(names)}, got {json.dumps(value)[:40]}"]
    errors = []
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        errors.append(f"{path}: {json.dumps(value)[:40]} is not one of {json.dumps(schema['enum'])}")
    if "const" in schema and not _same(value, schema["const"]):
        errors.append(f"{path}: expected {json.dumps(schema['const'])}")
    if isinstance(value, str):
        errors += _bounds(path, "length", len(value), schema.get("minLength"), schema.get("maxLength"))
    if _is_type(value, "number"):
        errors += _bounds(path, "value", value, schema.get("minimum"), schema.get("maximum"))
    if isinstance(value, list):
        errors += _bounds(path, "item count", len(value), schema.get("minItems"), schema.get("maxItems"))
        if "items" in schema:
            for i, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        errors += _object_errors(value, schema, path)
    return errors


def _bounds(path: str, what: str, value: float, low: float | None, high: float | None) -> list[str]:
    if low is not None and value < low:
        return [f"{path}: {what} {value} is below the minimum {low}"]
    if high is not None and value > high:
        return [f"{path}: {what} {value} is above the maximum {high}"]
    return []


def _object_errors(value: dict[str, Any], schema: Mapping[str, Any], path: str) -> list[str]:
    properties = schema.get("properties", {})
    errors = [f"{path}: required property {key!r} is missing" for key in schema.get("required", []) if key not in value]
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], f"{path}.{key}")
        elif extra is False:
            errors.append(f"{path}: property {key!r} is not allowed")
        elif extra is not True:
            errors += schema_errors(item, extra, f"{path}.{key}")
    return errors


@dataclass(frozen=True)
class OutputCheck:
    """One output against its schema: whether it parses as JSON, whether it follows the schema,
    and the first problem (None for a valid output)."""

    parsed: bool
    valid: bool
    error: str | None = None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_output(text: str, schema: Mapping[str, Any]) -> OutputCheck:
    """Parse ``text`` as one JSON value (whitespace around it allowed, nothing else) and validate it."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError as e:  # json.JSONDecodeError, or a number too large to convert
        return OutputCheck(False, False, f"not JSON: {e}")
    errors = schema_errors(value, schema)
    return OutputCheck(True, not errors, errors[0] if errors else None)


def method_figures(samples: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per method, over its runs on prompts with a schema (samples whose ``schema_valid`` is set):
    ``schema_runs``, ``json_parsed_fraction``, ``schema_valid_fraction``, and where the method
    reports forced tokens, ``forced_tokens`` and ``forced_token_share`` (forced / generated tokens:
    the tokens the grammar fixed, drafted at no model cost). Methods with no such runs are left out."""
    by_method: dict[str, list[Any]] = {}
    for s in samples:
        if getattr(s, "schema_valid", None) is not None:
            by_method.setdefault(s.method, []).append(s)
    out = {}
    for method, runs in by_method.items():
        figures: dict[str, Any] = {
            "schema_runs": len(runs),
            "json_parsed_fraction": sum(bool(s.json_parsed) for s in runs) / len(runs),
            "schema_valid_fraction": sum(bool(s.schema_valid) for s in runs) / len(runs),
            "forced_tokens": None, "forced_token_share": None,
        }
        if all(s.forced_tokens is not None for s in runs):
            forced, tokens = sum(s.forced_tokens for s in runs), sum(s.new_tokens for s in runs)
            figures |= {"forced_tokens": forced, "forced_token_share": forced / tokens if tokens else 0.0}
        out[method] = figures
    return out


def markdown(figures: Mapping[str, Mapping[str, Any]]) -> str:
    """The figures of :func:`method_figures` as a Markdown table ('' for none)."""
    if not figures:
        return ""
    lines = ["Schema-constrained output (runs on prompts with a JSON schema):", "",
             "| method | runs | parses as JSON | follows its schema | forced tokens |", "|---|---:|---:|---:|---:|"]
    for method, f in figures.items():
        forced = "n/a" if f["forced_token_share"] is None else f"{f['forced_token_share']:.1%} ({f['forced_tokens']})"
        lines.append(f"| {method} | {f['schema_runs']} | {f['json_parsed_fraction']:.0%} | "
                     f"{f['schema_valid_fraction']:.0%} | {forced} |")
    return "\n".join(lines)
