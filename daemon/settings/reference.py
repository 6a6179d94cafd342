"""README's configuration reference, rendered from the settings table: one row per setting
(flags, environment variables, default, meaning, and who takes it), the variables cpud reads
that set no flag, and how the environment's values are read."""

from __future__ import annotations

import re
import textwrap

from cpud.settings import COMMANDS, ENGINE, SETTINGS, Setting

BEGIN = "<!-- BEGIN cpud.settings reference: `python3 -m cpud.settings --readme README.md` -->"
END = "<!-- END cpud.settings reference -->"

# Variables read where they are used (cpud.placement.binding), setting no flag:
# (name, default, meaning).
ENVIRONMENT_ONLY = (
    ("CPU_VISIBLE_MEMORY_NODES", "all", "NUMA nodes to use, in rank order (`1,0`)"),
)

INTRO = (
    "Every flag can also be set in the environment: `--foo-bar` as `CPUD_FOO_BAR`, plus "
    "vLLM's names where vLLM has one. A flag beats the environment, which beats the default. "
    "`cpud serve --help` (and `cpud doctor --help` for its flags) lists the same, and "
    "`deploy/cpud.env` documents every variable. The last column names the commands that take "
    "the flag and the keyword of the offline `LLM(...)`."
)
HEADER = ("flag", "environment", "default", "unit, meaning", "taken by")


def render_markdown() -> str:
    """The reference section's text (between the markers in README.md)."""
    rows = [_row(item) for item in SETTINGS]
    rows += [
        ("", f"`{name}`", default, meaning, "all") for name, default, meaning in (ENVIRONMENT_ONLY)
    ]
    lines = [_wrap(INTRO), "", _line(HEADER), _line(("---",) * len(HEADER))]
    lines += [_line(row) for row in rows]
    lines += ["", _wrap(_booleans_note())]
    return "\n".join(lines) + "\n"


def replace_section(readme: str) -> str:
    """`readme` with the text between its markers rendered anew (ValueError without them)."""
    start, end = _section_bounds(readme)
    return readme[:start] + render_markdown() + readme[end:]


def readme_section(readme: str) -> str:
    """The text between the markers of `readme`."""
    start, end = _section_bounds(readme)
    return readme[start:end]


def _section_bounds(readme: str) -> tuple[int, int]:
    begin, end = readme.find(BEGIN + "\n"), readme.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"no reference section: {BEGIN!r} ... {END!r}")
    return begin + len(BEGIN) + 1, end


def _row(item: Setting) -> tuple[str, ...]:
    envs = ", ".join(f"`{name}`" for name in item.env_names)
    return (_flags(item), envs, _default(item), item.details or item.help, _taken_by(item))


def _flags(item: Setting) -> str:
    if not item.flags:
        return ""
    first = item.long_flag
    if item.metavar and item.type is not bool:
        first += f" {item.metavar}" + ("..." if item.many else "")
    forms = [first, *(f for f in item.flags if f != item.long_flag)]
    if item.negatable:
        forms.append("--no-" + item.long_flag.removeprefix("--"))
    return ", ".join(f"`{form}`" for form in forms)


def _default(item: Setting) -> str:
    value = item.default
    if item.shown_default is not None:
        return item.shown_default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str):
        return f"`{value}`"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _taken_by(item: Setting) -> str:
    taken = [command for command in COMMANDS if command in item.groups]
    if ENGINE in item.groups:
        keywords = (item.name, *item.keyword_aliases)
        taken.append("`LLM(" + " / ".join(f"{k}=" for k in keywords) + ")`")
    return ", ".join(taken)


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def _line(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def _cell(text: str) -> str:
    """Text in a table cell: a `|` escaped (also inside code spans, as GitHub reads them)."""
    return re.sub(r"(?<!\\)\|", r"\\|", text)


def _booleans_note() -> str:
    from cpud.settings.envs import FALSE_WORDS, TRUE_WORDS

    pairs = [f"`{yes}/{no}`" for yes, no in zip(TRUE_WORDS, FALSE_WORDS)]
    spelled = ", ".join(pairs[:-1]) + f" or {pairs[-1]}"
    return (
        f"Booleans in the environment take {spelled}. A value that does not parse stops the "
        "daemon with `cpud: error: CPUD_PORT='abc' (sets --port): ...` and exit 2."
    )
