"""One decoding option as every front end spells it: :class:`Option`, and the readers of its text.

:mod:`specdec.config` holds the method's, the policy's, the tree's and the sampling options; each
drafter declares its own in its :class:`~specdec.drafters.registry.DrafterSpec`, so this module
sits below both and imports nothing of specdec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

MAX_INT = 2**31 - 1  # the largest count an option takes (draft lengths, tree sizes); beyond it, an error
GROUPS = ("method", "drafter", "policy", "tree", "sampling")


@dataclass(frozen=True)
class Option:
    """One decoding option. ``group``: ``method`` (a field of its own), ``drafter``, ``policy``
    or ``tree`` (a key of ``drafter_options``, ``policy_options`` or ``tree``), ``sampling``.
    Method, drafter, policy and tree options are the text form's; ``flag`` is the command line's
    spelling (None: not on the command line); ``read`` turns a text value into the field's value
    (raising ``ValueError``); ``choices`` reads the registry of allowed names; ``write`` turns a
    value back into its text (None: :meth:`format`'s plain rule)."""

    group: str
    name: str
    read: Callable[[str], Any]
    accepts: str
    default: Any
    help: str
    flag: str | None = None
    choices: Callable[[], Sequence[str]] | None = None
    write: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"option {self.name!r}: group must be one of {', '.join(GROUPS)}, got {self.group!r}")

    @property
    def in_text(self) -> bool:
        return self.group != "sampling"

    @property
    def dest(self) -> str | None:
        """The argparse destination of :attr:`flag`."""
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")

    def value(self, text: str) -> Any:
        """The value ``text`` stands for; a ``ValueError`` saying what the option takes if none."""
        try:
            value = self.read(text.strip())
        except ValueError as err:
            if self.name == "choices":  # parse_choices says which path is wrong and why
                raise ValueError(str(err)) from None
            raise ValueError(f"{self.name}= takes {self.accepts}, got {text!r}") from None
        if self.choices is not None and value not in self.choices():
            raise ValueError(f"{self.name}= takes one of {', '.join(self.choices())}, got {text!r}")
        return value

    def format(self, value: Any) -> str:
        """The text of ``value`` (``value(format(v)) == v``)."""
        if self.write is not None:
            return self.write(value)
        if isinstance(value, tuple):
            return "/".join(map(str, value))
        return str(value)


def integer_from(low: int, high: float = MAX_INT + 1) -> Callable[[str], int]:
    """A reader of the integers in ``[low, high)``."""
    def read(text: str) -> int:
        value = int(text)
        if not low <= value < high:
            raise ValueError(text)
        return value

    return read


def real(test: Callable[[float], bool]) -> Callable[[str], float]:
    """A reader of the finite numbers that pass ``test``."""
    def read(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or not test(value):
            raise ValueError(text)
        return value

    return read


def layer_indices(text: str) -> tuple[int, ...]:
    """Layer indices from 0, joined by ``/``."""
    value = tuple(int(x) for x in text.split("/"))
    if any(x < 0 for x in value):
        raise ValueError(text)
    return value


def nonempty(text: str) -> str:
    """A non-empty text (a path, a name)."""
    if not text:
        raise ValueError(text)
    return text


def as_name(text: str) -> str:
    """A name, checked against the option's ``choices`` where it has them."""
    return text


positive = integer_from(1)
fraction = real(lambda v: 0.0 <= v <= 1.0)
