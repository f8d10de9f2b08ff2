"""Render docs/reference/configuration.md from ``graphgear.config``.

Every option's dotted path, default, allowed values and description come from the
``Option`` declarations in ``src/graphgear/config.py`` (``CompilerConfig.option_paths()``),
each section's introduction from its class docstring. Run it after changing an option:

    python scripts/gen_config_docs.py           # rewrite the page
    python scripts/gen_config_docs.py --check   # exit 1 if the page is out of date

``tests/test_docs.py`` fails when the committed page and :func:`render` disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "configuration.md"
REGENERATE = "python scripts/gen_config_docs.py"

_HEAD = f"""\
# Configuration reference

<!-- Generated from src/graphgear/config.py by scripts/gen_config_docs.py: do not edit by
hand. Change an option's description in config.py, then run `{REGENERATE}`. -->

Every option of `graphgear.CompilerConfig`, by its dotted path. A config is a tree of
sections, one per concern; each option checks every value assigned to it and raises
`graphgear.ConfigError` (also a `ValueError`) naming the option and what it allows. An
unknown name raises too, listing the names that exist. Values live on the instance: two
configs, and two backends, never share state, and a backend keeps its own copy of the
config it was built from.

## Setting options

The same checks apply whichever way an option is set:

```python
import graphgear
from graphgear.config import apply_options

# attributes of a CompilerConfig, handed to get_backend
config = graphgear.CompilerConfig()
config.mode = "reduce-overhead"
config.capture_config.capture_limit = 16
backend = graphgear.get_backend(config)

# a dict: nested (as config.as_dict() gives it) or by dotted path
same = graphgear.CompilerConfig.from_dict({{"mode": "reduce-overhead", "capture_config.capture_limit": 16}})
print(same == config)

# torch.compile(..., options={{...}}) keys: dotted paths or unique leaf names
other = apply_options(graphgear.CompilerConfig(), {{"mode": "reduce-overhead", "capture_limit": 16}})
print(other == config)

try:
    config.capture_config.capture_limit = 0
except graphgear.ConfigError as e:
    print(e)
```

```output
True
True
graphgear: option 'capture_config.capture_limit' got 0; allowed values: an int >= 1.
```

With `torch.compile`, pass the config through `get_backend`, or name the backend
`"graphgear"` and give the options as a dict (see [`options=` keys](#options-keys)):

```python
import torch
import graphgear

model = torch.nn.Linear(8, 8)
config = graphgear.CompilerConfig()
config.mode = "reduce-overhead"
compiled = torch.compile(model, backend=graphgear.get_backend(config))
same = torch.compile(model, backend="graphgear", options={{"mode": "reduce-overhead"}})
```

Nothing compiles until the first call.
"""


def _md(text: str) -> str:
    """``text`` (a docstring or an option's description) as Markdown for a table cell:
    RST double backticks become code spans; outside code spans ``*`` and ``<`` are
    escaped; ``|`` is escaped everywhere (GitHub tables split on it even in code)."""
    text = " ".join(text.replace("``", "`").split())
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            part = part.replace("*", r"\*").replace("<", "&lt;")
        out.append(part.replace("|", r"\|"))
    return "".join(out)


def _sentence(text: str) -> str:
    text = text.strip()
    if text and text[0].isalpha():
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _code(value: Any) -> str:
    return "`" + repr(value).replace("|", r"\|") + "`"


def _allowed(opt: Any) -> str:
    if opt.choices is not None:
        return ", ".join(_code(c) for c in opt.choices)
    return _md(opt.allowed)


def _sections() -> list[tuple[str, type]]:
    """``(dotted prefix, section class)`` for the root and every sub-section, depth first
    in declaration order."""
    from graphgear.config import CompilerConfig

    out: list[tuple[str, type]] = []

    def walk(cls: Any, prefix: str) -> None:
        out.append((prefix, cls))
        for name, sub in cls._sections().items():
            walk(sub, f"{prefix}{name}.")

    walk(CompilerConfig, "")
    return out


def _aliases() -> dict[str, str]:
    """Alias leaf name -> dotted path of the option it stands for."""
    return {alias: prefix + target for prefix, cls in _sections()
            for alias, target in getattr(cls, "_aliases", {}).items()}


def _option_table(prefix: str, cls: Any) -> list[str]:
    lines = ["| Option | Default | Allowed values | Description |", "| --- | --- | --- | --- |"]
    for name, opt in cls._options().items():
        lines.append(f"| `{prefix}{name}` | {_code(opt.default)} | {_allowed(opt)} | "
                     f"{_md(_sentence(opt.doc))} |")
    return lines


def _options_keys() -> list[str]:
    from graphgear.backend import _TORCH_MODES
    from graphgear.config import CompilerConfig

    paths = list(CompilerConfig.option_paths())
    leaves: dict[str, list[str]] = {}
    for p in paths:
        leaves.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    lines = [
        "## `options=` keys",
        "",
        '`torch.compile(model, backend="graphgear", options={...})` starts from the default',
        "config; `torch.compile(model, backend=graphgear.get_backend(config), options={...})`",
        "starts from a copy of `config`. Either way each key is applied in turn, checked as",
        "an assignment is (`graphgear.config.apply_options`). A key is an option's dotted",
        "path from the tables above, or its last component when no other option shares it:",
        "",
        "| Key | Option |",
        "| --- | --- |",
    ]
    for leaf in sorted(leaves):
        if len(leaves[leaf]) == 1 and leaves[leaf][0] != leaf:
            lines.append(f"| `{leaf}` | `{leaves[leaf][0]}` |")
    from graphgear.config import OPTION_ALIASES

    aliases = {**_aliases(), **OPTION_ALIASES}
    for alias, target in sorted(aliases.items()):
        lines.append(f"| `{alias}` (alias) | `{target}` |")
    lines += ["", "The aliases are TorchAir's names (its `npugraph_ex` options); "
              "[Coming from TorchAir](../guides/coming-from-torchair.md) says what each one does here."]
    ambiguous = sorted(leaf for leaf, ps in leaves.items() if len(ps) > 1 and leaf not in ps)
    if ambiguous:
        lines += ["", "These names are shared by several options and need the full path: "
                  + "; ".join(f"`{leaf}` ({', '.join(f'`{p}`' for p in leaves[leaf])})"
                              for leaf in ambiguous) + "."]
    shadowed = sorted(leaf for leaf, ps in leaves.items() if len(ps) > 1 and leaf in ps)
    for leaf in shadowed:
        others = ", ".join(f"`{p}`" for p in leaves[leaf] if p != leaf)
        lines += ["", f"`{leaf}` is the top-level option `{leaf}`; {others} needs its full path."]
    modes = ", ".join(f"`{k!r}` sets `mode` to `{v!r}`" if v else f"`{k!r}` keeps the config's mode"
                      for k, v in _TORCH_MODES.items())
    lines += [
        "",
        "An unknown or ambiguous key raises `graphgear.ConfigError` listing the keys that",
        "work. `guard_filter_fn` is taken by `torch.compile` itself and never reaches",
        "graphgear (`graphgear.inference.serve` passes one).",
        "",
        f"`torch.compile(mode=...)` works too, on its own: {modes}. Any other mode raises",
        "`graphgear.ConfigError`. `torch.compile` refuses `mode=` and `options=` together;",
        "to set both, put `\"mode\"` among the options.",
    ]
    return lines


def _pass_names() -> list[str]:
    from graphgear.passes import pass_names

    return [
        "## Pass names",
        "",
        "The names `experimental_config.disabled_passes` accepts, in the order the passes",
        "run (`graphgear.passes.pass_names()`); any other name raises when the backend is",
        "built:",
        "",
        ", ".join(f"`{n}`" for n in pass_names()) + ".",
    ]


def render() -> str:
    """The whole page, as :data:`PAGE` should hold it."""
    lines = [_HEAD]
    for prefix, cls in _sections():
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        lines += [f"## {title}", ""]
        if prefix:
            # the heading names the section: drop a docstring's leading "``name``: "
            doc = re.sub(r"^``[\w.]+``:\s*", "", (cls.__doc__ or "").strip())
            doc = doc[:1].upper() + doc[1:]
            if doc:
                lines += [_md(doc), ""]
        else:
            lines += ["Options directly on `CompilerConfig`.", ""]
        if cls._options():
            lines += [*_option_table(prefix, cls), ""]
        subs = [f"`{prefix}{name}`" for name in cls._sections()]
        if subs:
            lines += [f"Sections: {', '.join(subs)}.", ""]
    lines += [*_options_keys(), "", *_pass_names()]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        print(f"{PAGE.relative_to(ROOT)} is up to date")
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's graphgear, not another install
    sys.exit(main())
