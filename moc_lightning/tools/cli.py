"""``key=value`` command lines for the recipes that are not Hydra apps (the same look as Hydra overrides)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def parse_key_values(
    argv: Sequence[str], allowed: Iterable[str], defaults: Mapping[str, str] | None = None, required: Iterable[str] = ()
) -> dict[str, str]:
    """Parse ``key=value`` arguments; an unknown key or a missing required one exits with the allowed keys."""
    allowed = set(allowed)
    args = dict(defaults or {})
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in allowed:
            raise SystemExit(f"bad argument {arg!r}: expected key=value with key in {sorted(allowed)}")
        args[key] = value
    missing = [key for key in required if key not in args]
    if missing:
        raise SystemExit(f"missing {', '.join(f'{key}=...' for key in missing)}")
    return args
