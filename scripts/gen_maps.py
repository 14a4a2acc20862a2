"""The module maps and the CLI reference, generated from the tree as it is.

Each module's docstring says first what it owns; the map of the daemon's modules in
docs/development.md is those first lines, package by package from the top layer down (the
layers of scripts/check_imports.py), the README's is each package's, and a package's own
docstring may hold the map of its folder. docs/cli.md is every `kvkeep` command and option, from
click's own help. A map sits between `<!-- generated: NAME -->` and `<!-- end -->` so the
prose around it stays hand-written.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
DAEMON = ROOT / "daemon" / "kvkeepd"
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "client"))

from check_imports import LAYERS, layer_of  # noqa: E402

README = ROOT / "README.md"
DEVELOPMENT = ROOT / "docs" / "development.md"
CLI_PAGE = ROOT / "docs" / "cli.md"
TESTS = ROOT / "tests"
# What each folder of tests/ holds (a folder has no __init__.py: its files import the helpers
# of tests/support/ by name, and a test file its neighbours').
TEST_FOLDERS = {
    "support": "the helpers every test imports: daemons, servers, test models, certificates",
    "unit": "pure code, no daemon",
    "daemon": "one daemon over gRPC: sessions, generation, checkpoints, tools, limits, start-up",
    "durability": "what survives: crashes, faults, the state directory, tiers and budgets, integrity",
    "http": "the HTTP door: OpenAI chat, completions and Responses, Anthropic's Messages, browsers",
    "cluster": "several daemons: shared catalogs and stores, routing, Redis, S3, HAProxy",
    "clients": "the SDK, the CLI, LangChain, the README and docs as printed, packaging",
}
# The width of a package docstring's map, within the code's line length.
WIDTH = 96


class Unmarked(Exception):
    """A page without the markers of a generated block, or a module without a docstring."""


def first_line(path: Path) -> str:
    """The first sentence of the module's docstring: what it owns."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise Unmarked(f"{path.relative_to(ROOT)} has no docstring")
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", paragraph)[0]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "daemon").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_map() -> str:
    """Every package and module of the daemon, from the top layer down."""
    packages = sorted(
        (p for p in DAEMON.rglob("__init__.py") if "__pycache__" not in p.parts),
        key=lambda p: (-layer_of(_module(p))[0], p.parent.relative_to(DAEMON).parts),
    )
    layers = "; ".join(", ".join(f"`{m}`" for m in layer) for layer in reversed(LAYERS))
    lines = [f"Layers, top first (scripts/check_imports.py): {layers}.", ""]
    for init in packages:
        folder = init.parent.relative_to(ROOT).as_posix() + "/"
        lines.append(f"- `{folder}`: {first_line(init)}")
        for path in sorted(init.parent.glob("*.py")):
            if path.name != "__init__.py":
                lines.append(f"  - `{path.name}`: {first_line(path)}")
    return "\n".join(lines)


def tests_map() -> str:
    """Every test file by folder with its first sentence, then which test files import each
    daemon module directly (most tests reach the daemon through the SDK or HTTP instead)."""
    folders = sorted({p.parent.name for p in TESTS.glob("*/*.py")})
    unknown = set(folders) - set(TEST_FOLDERS)
    if unknown:
        raise Unmarked(f"tests/{sorted(unknown)[0]}/ is not described in TEST_FOLDERS")
    lines: list[str] = []
    importers: dict[str, set[str]] = {}
    for folder in TEST_FOLDERS:
        files = sorted((TESTS / folder).glob("*.py"))
        if not files:
            continue
        lines.append(f"- `tests/{folder}/`: {TEST_FOLDERS[folder]}")
        for path in files:
            lines.append(f"  - `{path.name}`: {first_line(path)}")
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvkeepd"):
                    importers.setdefault(str(node.module), set()).add(f"{folder}/{path.name}")
    lines += ["", "Daemon modules and the test files that import them:", ""]
    for module in sorted(importers):
        lines.append(f"- `{module}`: " + ", ".join(f"`{t}`" for t in sorted(importers[module])))
    return "\n".join(lines)


def packages_map() -> str:
    """The daemon's packages and leaves, from the top layer down, for the README."""
    lines = []
    # The leaves are every module and package at the root that no higher layer places.
    roots = sorted([*DAEMON.glob("*.py"), *(p.parent for p in DAEMON.glob("*/__init__.py"))])
    leaves = [_module(p) for p in roots if layer_of(_module(p))[0] == 0]
    for layer in [*reversed(LAYERS[1:]), leaves]:
        for name in layer:
            path = DAEMON.parent.joinpath(*name.split("."))
            init = path / "__init__.py"
            if name == "kvkeepd" or not (init.is_file() or path.with_suffix(".py").is_file()):
                continue
            shown = f"{path.relative_to(DAEMON).as_posix()}/" if init.is_file() else f"{path.name}.py"
            lines.append(f"- `{shown}`: {first_line(init if init.is_file() else path.with_suffix('.py'))}")
            if init.is_file():
                for sub in sorted(p.parent for p in path.glob("*/__init__.py")):
                    lines.append(f"  - `{sub.name}/`: {first_line(sub / '__init__.py')}")
    return "\n".join(lines)


def splice(text: str, name: str, body: str) -> str:
    """`text` with its block `name` replaced by `body`."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(\n<!-- end -->)", re.S)
    if not pattern.search(text):
        raise Unmarked(f"no <!-- generated: {name} --> ... <!-- end --> block")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text, count=1)


def _command(command: click.Command, path: str, lines: list[str]) -> None:
    context = click.Context(command, info_name=path, terminal_width=92, max_content_width=92)
    lines += ["", f"## `{path}`", "", "```text", command.get_help(context).rstrip(), "```"]
    if isinstance(command, click.Group):
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            if sub is not None and not sub.hidden:
                _command(sub, f"{path} {name}", lines)


def cli_page() -> str:
    """docs/cli.md: every command of `kvkeep`, with its options, as `--help` prints them."""
    from kvkeep.cli import main

    lines = [
        "<!-- Generated by scripts/gen-docs from the click commands of client/kvkeep/cli/:",
        "edit those, then run scripts/gen-docs. scripts/check fails while this page is stale. -->",
        "",
        "# CLI reference",
        "",
        "Every `kvkeep` command and its options, as `kvkeep ... --help` prints them. The",
        "settings of `kvkeep serve` are in [configuration.md](configuration.md).",
    ]
    _command(main, "kvkeep", lines)
    return "\n".join(lines) + "\n"


def package_map(init: Path) -> str:
    """The modules and packages in `init`'s folder, each with its first sentence, wrapped."""
    entries = sorted(p for p in init.parent.glob("*.py") if p.name != "__init__.py")
    entries += sorted(p / "__init__.py" for p in init.parent.iterdir() if (p / "__init__.py").is_file())
    lines = []
    for path in entries:
        name = f"{path.parent.name}/" if path.name == "__init__.py" else path.name
        lines += textwrap.wrap(
            f"- {name}: {first_line(path)}", width=WIDTH, subsequent_indent="  ", break_on_hyphens=False
        )
    return "\n".join(lines)


def _marked_packages() -> list[Path]:
    """The daemon's packages whose docstring holds a generated map."""
    return [p for p in sorted(DAEMON.rglob("__init__.py")) if "<!-- generated: modules -->" in p.read_text()]


def pages() -> dict[Path, str]:
    """Each generated page's path and the text it should hold."""
    maps = {p: splice(p.read_text(), "modules", package_map(p)) for p in _marked_packages()}
    return {
        **maps,
        README: splice(README.read_text(), "packages", packages_map()),
        DEVELOPMENT: splice(splice(DEVELOPMENT.read_text(), "modules", modules_map()), "tests", tests_map()),
        CLI_PAGE: cli_page(),
    }
