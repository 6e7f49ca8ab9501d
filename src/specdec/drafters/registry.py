"""The drafter registry: every drafter declares itself once, as a :class:`DrafterSpec`.

A spec says what the rest of the library needs to know of a drafter: its name (as method strings,
``--drafter`` and the API spell it), the options it takes (each an :class:`~specdec.options.Option`
row, as the text form, the command line and its help show it), what it needs of the target's
backend beyond its logits, whether it drafts with the draft model, whether it proposes token
trees and which tree options shape them, and how to build it. Each drafter module declares its spec beside its class
(``SPEC = DrafterSpec(name="ngram", ...)``) and :mod:`specdec.drafters` registers them, in the
order :func:`names` lists them.

Config parsing and checking (:mod:`specdec.config`), building (:mod:`specdec.build`), the server
and the benchmark read the registry when they run, never a copy made at import: a drafter
registered later (by a program of its own, or a test) is a drafter everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from specdec.drafters.base import Drafter
from specdec.options import Option

TREES = ("no", "also", "only")  # a drafter proposes chains only, chains or trees, trees only (verify="tree")

# create(target, draft, **options): the drafter, for the target's backend (from
# specdec.build.target_backend) and the draft model's backend (None for a drafter that uses none).
# An option it does not take is a TypeError (the build reports it as a bad option).
Create = Callable[..., Drafter]
# tree(drafter, tree_options): (what proposes the trees, the tree's shape as method names print
# it); tree_options is the config's ``tree`` (None: the drafter's default tree).
Tree = Callable[[Any, Mapping[str, Any] | None], tuple[Any, str]]


@dataclass(frozen=True)
class DrafterSpec:
    """What the library knows of one drafter.

    name: how methods name it (no ``:``, ``=`` or spaces). create: builds it (:data:`Create`).
    options: the keyword options ``create`` takes, as :class:`~specdec.options.Option` rows of group
    ``drafter`` (method strings give them as ``key=value``; the command line as each row's flag). Two
    drafters that take an option of the same name share its row.
    needs: the target backend's capabilities it reads beyond the logits
    (:data:`~specdec.backends.base.LAYERS`, :data:`~specdec.backends.base.HIDDEN_STATES`).
    uses_draft_model: it drafts with the draft model (``create`` gets its backend; without
    one the build refuses it). trees: ``"no"``, ``"also"`` (chains, or token trees under
    ``verify="tree"``) or ``"only"`` (token trees only). tree: for a drafter that proposes trees,
    the drafter that proposes them and the tree's shape (:data:`Tree`). cls: the class ``create``
    builds, so that a drafter object given directly is known as this drafter (for its trees);
    None: known by its ``name``. tree_keys: for a drafter whose trees are its own, the tree options
    (positive integers) that shape them, ``()`` for none; None: its trees are the tree drafter's
    (:class:`~specdec.drafters.tree.TreeDrafter`), which every tree option shapes. static_tree: its
    trees are the tree drafter's static ones only, shaped by the tree option ``choices`` alone.
    """

    name: str
    create: Create
    options: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()
    uses_draft_model: bool = False
    trees: str = "no"
    tree: Tree | None = None
    cls: type | None = None
    tree_keys: tuple[str, ...] | None = None
    static_tree: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in ": =\t\n"):
            raise ValueError(f"a drafter's name is a non-empty word without ':', '=' or spaces, got {self.name!r}")
        if self.name in ("none", "ar", "spec"):
            raise ValueError(f"{self.name!r} names plain decoding or a method, not a drafter")
        if not callable(self.create):
            raise TypeError(f"the {self.name} drafter's create must be callable")
        object.__setattr__(self, "options", tuple(self.options))
        for option in self.options:
            if not isinstance(option, Option) or option.group != "drafter":
                raise TypeError(f"the {self.name} drafter's options are Option rows of group 'drafter', got {option!r}")
        if self.tree_keys is not None:
            object.__setattr__(self, "tree_keys", tuple(self.tree_keys))
        object.__setattr__(self, "needs", frozenset(self.needs))
        if self.trees not in TREES:
            raise ValueError(f"the {self.name} drafter's trees must be one of {', '.join(TREES)}, got {self.trees!r}")
        if (self.tree is None) != (self.trees == "no"):
            raise ValueError(f"the {self.name} drafter needs a tree function exactly when it proposes trees "
                             f"(trees={self.trees!r})")
        if (self.tree_keys is not None or self.static_tree) and self.trees == "no":
            raise ValueError(f"the {self.name} drafter proposes no trees, so no tree options shape them")
        if self.tree_keys is not None and self.static_tree:
            raise ValueError(f"the {self.name} drafter's trees are either its own (tree_keys) or static, not both")

    @property
    def option_names(self) -> tuple[str, ...]:
        """The names of the options it takes, in order."""
        return tuple(o.name for o in self.options)

    def describes(self, drafter: Any) -> bool:
        """Whether the drafter object ``drafter`` is one this spec builds (an instance of ``cls``,
        or without ``cls`` a drafter of this name)."""
        if self.cls is not None:
            return isinstance(drafter, self.cls)
        return getattr(drafter, "name", None) == self.name


_SPECS: dict[str, DrafterSpec] = {}  # by name, in registration order


def register(spec: DrafterSpec, *, replace: bool = False) -> DrafterSpec:
    """Add ``spec`` to the drafters every front end knows. A name already registered is a
    ``ValueError`` unless ``replace`` (which keeps the name's place in :func:`names`)."""
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"register takes a DrafterSpec, got {type(spec).__name__}")
    if spec.name in _SPECS and not replace:
        raise ValueError(f"a drafter named {spec.name!r} is already registered; pass replace=True to replace it")
    own = {o.name: o for o in spec.options}
    for other in _SPECS.values():  # an option name is one row, whichever drafters take it
        for option in other.options:
            if other.name != spec.name and own.get(option.name, option) != option:
                raise ValueError(f"the {spec.name} drafter's option {option.name!r} differs from the {other.name} "
                                 "drafter's; two drafters that take an option share its row")
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> DrafterSpec:
    """Remove the drafter named ``name`` (a ``ValueError`` if there is none); returns its spec."""
    return _SPECS.pop(spec(name).name)


def spec(name: str) -> DrafterSpec:
    """The spec of the drafter named ``name``; a ``ValueError`` naming the choices if there is none."""
    found = find(name)
    if found is None:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(names())}")
    return found


def find(name: Any) -> DrafterSpec | None:
    """The spec of the drafter named ``name``; None for anything else (an unknown name, ``"none"``,
    None, a drafter object)."""
    return _SPECS.get(name) if isinstance(name, str) else None


def names() -> tuple[str, ...]:
    """The registered drafters' names, in registration order."""
    return tuple(_SPECS)


def specs() -> tuple[DrafterSpec, ...]:
    """The registered specs, in registration order."""
    return tuple(_SPECS.values())


def options() -> tuple[Option, ...]:
    """Every registered drafter's options, each row once, in registration order."""
    rows: dict[str, Option] = {}
    for declared in _SPECS.values():
        for option in declared.options:
            rows.setdefault(option.name, option)
    return tuple(rows.values())


def option_row(name: str) -> Option | None:
    """The row of the drafter option named ``name``; None if no registered drafter takes one."""
    for option in options():
        if option.name == name:
            return option
    return None


def needs(name: Any) -> frozenset[str]:
    """What the drafter named ``name`` needs of the target's backend; nothing for anything that
    is not a registered name (the target alone, the default drafter, a drafter object)."""
    found = find(name)
    return found.needs if found is not None else frozenset()


__all__ = ["DrafterSpec", "TREES", "find", "names", "needs", "option_row", "options", "register", "spec", "specs",
           "unregister"]
