"""One way to build a drafter stack, shared by the CLI, `tools.bench` and the library.

A stack is written (bench method names, `parse_stack`) as

    PART                         one drafter
    CHEAP+STRONG                 TreeGraft: per round and row an action (CHEAP's chain, STRONG's tree, a graft,
                                 a recovered subtree, their union), chosen by `policy` (an action, switch,
                                 always, never, or a scheduler directory)
    MATCHES|MODEL                Switch: TreeGraft's switch policy: MATCHES' chain where its match is long,
                                 MODEL's tree elsewhere

followed by options `;key=value` (no spaces), e.g. `ngram|feature;min_match=3;model_tree=chain=3`,
`ngram+lm;policy=runs/sched` or `ngram+feature;policy=recover;strong_tree=chain=5;grow=3`. The CLI's `--drafter A --drafter B --switch 3` / `--treegraft DIR`
build the same `Stack`. Options of a composite are its constructor's (COMPOSITES); any other option
goes to the single drafter's `with_options` hook (a block drafter's confidence cut, DPara's boundaries,
ReaDy's zeroed state), so nothing here checks a drafter's name: a drafter that takes no such option
says so itself.

`build(stack, resolve)` turns a Stack into one drafter; `resolve` gives the drafter each part names
(the CLI loads them, `load_parts`; the bench looks them up among its loaded drafters).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from specjax.drafters import drafter_takes, load_drafter
from specjax.drafters.base import Drafter
from specjax.drafters.composite import treegraft as treegraft_lib
from specjax.drafters.composite.treegraft import Switch

@dataclasses.dataclass(frozen=True)
class Kind:
    """A composite as the builder knows it: the separator between its two parts' names, its options
    ({name: parser from text}), their defaults, and `make(drafters, parts, **options)`."""
    sep: str
    options: dict
    defaults: dict
    make: Callable


def _treegraft(drafters, parts, *, policy, **options):
    return treegraft_lib.build(drafters, policy, specs=parts, **options)  # a scheduler is checked against the parts


def _switch(drafters, parts, **options):
    return Switch(*drafters, **options)


COMPOSITES = {
    "treegraft": Kind("+", {"policy": str, "cheap_tree": str, "graft_nodes": int, "strong_tree": str, "grow": int,
                            "min_match": int}, {"policy": "always"}, _treegraft),
    "switch": Kind("|", {"min_match": int, "model_tree": str}, {"min_match": 3, "model_tree": "chain=3"}, _switch),
}
# options of a single drafter (`Drafter.with_options`), as parsed from text
SINGLE_OPTIONS = {"confidence": str, "boundaries": int, "zero_state": lambda v: v in ("1", "true", "yes", "on")}


@dataclasses.dataclass(frozen=True)
class Stack:
    parts: tuple[str, ...]  # drafter names or specs, cheapest first
    composite: str | None = None  # None (one drafter) or a key of COMPOSITES
    options: tuple[tuple[str, object], ...] = ()  # (key, value), sorted

    @classmethod
    def make(cls, parts: Sequence[str], composite: str | None = None, **options) -> "Stack":
        return cls(tuple(parts), composite, tuple(sorted((k, v) for k, v in options.items() if v is not None)))

    @property
    def opts(self) -> dict:
        return dict(self.options)

    def text(self) -> str:
        """The stack in `parse_stack`'s syntax."""
        sep = COMPOSITES[self.composite].sep if self.composite else ""
        return sep.join(self.parts) + "".join(f";{k}={v}" for k, v in self.options)


def parse_stack(text: str) -> Stack:
    """A Stack from its text (module docstring). Raises ValueError naming what is wrong."""
    head, *opts = text.split(";")
    composite, parts = None, (head,)
    for kind, spec in COMPOSITES.items():
        if spec.sep in head:
            parts = tuple(head.split(spec.sep))
            composite = kind
            break
    if not all(parts) or (composite and len(parts) != 2):
        raise ValueError(f"drafter stack {text!r}: expected PART, CHEAP+STRONG or MATCHES|MODEL")
    allowed = COMPOSITES[composite].options if composite else SINGLE_OPTIONS
    options = {}
    for o in opts:
        key, eq, value = o.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"drafter stack {text!r}: unknown option {o!r} (options: {', '.join(sorted(allowed))})")
        try:
            options[key] = allowed[key](value)
        except ValueError:
            raise ValueError(f"drafter stack {text!r}: option {key}={value!r} is not a valid value") from None
    return Stack.make(parts, composite, **options)


def build(stack: Stack, resolve: Callable[[str], Drafter] | Mapping[str, Drafter] | Sequence[Drafter]) -> Drafter:
    """The one drafter a stack describes. `resolve`: part -> drafter (a function or a mapping), or the
    parts' drafters themselves, in order."""
    if isinstance(resolve, Sequence):
        if len(resolve) != len(stack.parts):
            raise ValueError(f"drafter stack {stack.text()!r} has {len(stack.parts)} parts, got {len(resolve)} drafters")
        drafters = list(resolve)
    else:
        get = resolve.__getitem__ if isinstance(resolve, Mapping) else resolve
        drafters = [get(p) for p in stack.parts]
    opts = stack.opts
    if stack.composite is None:
        return drafters[0].with_options(**opts) if opts else drafters[0]
    if stack.composite not in COMPOSITES:
        raise ValueError(f"unknown composite {stack.composite!r} ({', '.join(COMPOSITES)})")
    kind = COMPOSITES[stack.composite]
    return kind.make(drafters, stack.parts, **{**kind.defaults, **opts})


def load_parts(specs: Sequence[str], target, *, target_path: str | None = None, tuned: bool = True,
               **options) -> list[Drafter]:
    """Each drafter spec loaded (`load_drafter`) with the options of `options` its kind takes
    (`drafter_takes`: FOLD for drafters that attend, a draft vocabulary, a confidence cut, ...): next to
    a drafter that takes an option, one that does not simply goes without it. An option no part takes
    is refused (the error names the option). `tuned`: each part's recorded defaults (`drafters.tuned`) fill in
    what `options` leaves out."""
    given = {k: v for k, v in options.items() if v is not None and not (k == "confidence" and v == "off")}
    takes = [drafter_takes(s) for s in specs]
    for name in given:
        if not any(name in t for t in takes):  # load_drafter's own words for the refusal
            load_drafter(specs[0], target, target_path=target_path, tuned=tuned, **{name: given[name]})
    return [load_drafter(s, target, target_path=target_path, tuned=tuned, **{k: v for k, v in given.items() if k in t})
            for s, t in zip(specs, takes)]
