"""Import boundaries: who may import llama_cpp, grpc and kvkeepd, the daemon's layers, and no
circles.

Every import counts, at the top of a module, inside a function or under TYPE_CHECKING (the
tree is walked whole). A daemon module may import a module of a lower layer (LAYERS) or of
its own folder, never one above, and inside a folder with rooms (ROOMS) the same again; no
modules import each other in a circle; and only the doors and the composition root reach the
session manager itself (the flows get a SessionHost).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = {
    # module prefix -> files (relative to the package) allowed to import it
    "llama_cpp": {"daemon/kvkeepd/engine/context.py", "daemon/kvkeepd/engine/backend.py"},
    "grpc": {"daemon/kvkeepd/api/service.py", "daemon/kvkeepd/api/grpc_door.py", "daemon/kvkeepd/server.py"},
    "grpc_health": {"daemon/kvkeepd/api/grpc_door.py", "daemon/kvkeepd/server.py"},
    "grpc_reflection": {"daemon/kvkeepd/api/grpc_door.py"},
    # The HTTP door's stack (an optional extra) stays inside its package.
    "starlette": {
        "daemon/kvkeepd/api/http/app.py",
        "daemon/kvkeepd/api/http/body.py",
        "daemon/kvkeepd/api/http/chat/door.py",
        "daemon/kvkeepd/api/http/handlers.py",
        "daemon/kvkeepd/api/http/responses/door.py",
        "daemon/kvkeepd/api/http/waiting.py",
        "daemon/kvkeepd/api/http/anthropic/door.py",
        "daemon/kvkeepd/api/http/console/routes.py",
    },
    "uvicorn": {"daemon/kvkeepd/api/http/door.py", "daemon/kvkeepd/api/http/guard.py"},
    # Models from the Hugging Face Hub (--model hf:..., kvkeep pull), fetched before the daemon starts.
    "huggingface_hub": {"daemon/kvkeepd/model/hub.py"},
    "pydantic": {
        "daemon/kvkeepd/api/http/app.py",
        "daemon/kvkeepd/api/http/body.py",
        "daemon/kvkeepd/api/http/chat/schema.py",
        "daemon/kvkeepd/api/http/responses/schema.py",
        "daemon/kvkeepd/api/http/anthropic/door.py",
        "daemon/kvkeepd/api/http/anthropic/schema.py",
    },
}
# The same for the SDK: LangChain (an optional extra) only in its integration.
CLIENT_RULES = {
    "langchain_core": {
        f"client/kvkeep/integrations/langchain/{name}.py"
        for name in ("__init__", "_chat", "_history", "_messages")
    },
}


# The daemon's layers, lowest first: a module's layer is that of the longest prefix listed.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kvkeepd",
        "kvkeepd.errors",
        "kvkeepd.request_limits",
        "kvkeepd.logs",
        "kvkeepd.heap",
        "kvkeepd.values",
        "kvkeepd.model",
        "kvkeepd.files",
        "kvkeepd.urls",
    ),
    ("kvkeepd.config", "kvkeepd.state", "kvkeepd.tools"),
    ("kvkeepd.engine", "kvkeepd.storage"),
    ("kvkeepd.sessions",),
    ("kvkeepd.api",),
    ("kvkeepd.server",),
    ("kvkeepd.cli",),
    ("kvkeepd.__main__",),
)
# Rooms inside a folder of LAYERS, lowest first, held like the layers: a module may import a
# module of a lower room or of its own, never one above nor sideways to another of its rank.
ROOMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "kvkeepd.sessions": (
        ("kvkeepd.sessions",),  # the vocabulary: session, tenants, ops, host, placement...
        ("kvkeepd.sessions.prompting", "kvkeepd.sessions.durability"),
        ("kvkeepd.sessions.memory",),
        ("kvkeepd.sessions.flows",),
        ("kvkeepd.sessions.manager",),
    ),
}
# Who may import the session manager (the flows are given a SessionHost instead).
MANAGER = "kvkeepd.sessions.manager"
MANAGER_USERS = ("kvkeepd.api", "kvkeepd.server", "kvkeepd.sessions.manager")
# One hop from a door: outside sessions/, code calls the manager's own methods and reads only
# these values of it, never a part of it (`manager.checkpoints.restore`).
MANAGER_VALUES = {"settings", "model"}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "daemon").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[int, str]:
    """(layer, the prefix that places it): the longest listed prefix of `module`."""
    best = (-1, "")
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (i, prefix)
    return best


def room_of(module: str, folder: str) -> tuple[int, str]:
    """(rank, the prefix that places it) of `module` among `folder`'s ROOMS; (-1, "") if none."""
    best = (-1, "")
    for i, prefixes in enumerate(ROOMS.get(folder, ())):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (i, prefix)
    return best


def daemon_graph() -> dict[str, set[str]]:
    """Each daemon module's imports of other daemon modules."""
    paths = {module_of(p): p for p in (ROOT / "daemon").rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names if a.name.startswith("kvkeepd"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvkeepd"):
                for a in node.names:  # `from kvkeepd.x import y` may name the module x.y
                    full = f"{node.module}.{a.name}"
                    out.add(full if full in paths else resolve(node.module))
        graph[module] = out - {module, ""}
    return graph


def layer_errors(graph: dict[str, set[str]]) -> list[str]:
    errors = []
    for module, targets in sorted(graph.items()):
        layer, prefix = layer_of(module)
        if layer < 0:
            errors.append(f"{module}: in no layer (add it to LAYERS)")
            continue
        for target in sorted(targets):
            their, their_prefix = layer_of(target)
            if their > layer or (their == layer and their_prefix != prefix and layer > 0):
                errors.append(
                    f"{module} (layer {layer}) imports {target} (layer {their}): upward or sideways"
                )
            if their_prefix == prefix and prefix in ROOMS:
                room, room_prefix = room_of(module, prefix)
                their_room, their_room_prefix = room_of(target, prefix)
                if their_room > room or (their_room == room and their_room_prefix != room_prefix):
                    errors.append(
                        f"{module} (room {room_prefix}) imports {target} (room {their_room_prefix}): "
                        "upward or sideways inside its folder"
                    )
            if target == MANAGER and not module.startswith(MANAGER_USERS):
                errors.append(f"{module} imports the session manager: give it a SessionHost")
    return errors


def hop_errors(module: str, tree: ast.AST) -> list[str]:
    """Where `module`, outside sessions/, reaches through the manager into one of its parts."""
    if module.startswith("kvkeepd.sessions"):
        return []

    def is_manager(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "manager") or (
            isinstance(node, ast.Attribute) and node.attr == "manager"
        )

    errors = []
    # The attribute nodes something is read from: `manager.part` in `manager.part.method`.
    read_from = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_manager(node.value):
            continue
        part = node.attr
        if part.startswith("_") or (id(node) in read_from and part not in MANAGER_VALUES):
            errors.append(
                f"{module}:{node.lineno} reaches into the manager's {part!r}: call a SessionManager method"
            )
    return errors


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def main() -> int:
    errors = []
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for name in imports(path):
            top = name.split(".")[0]
            allowed = RULES.get(top)
            if allowed is not None and rel not in allowed:
                errors.append(f"{rel}: imports {name}")
    for path in sorted((ROOT / "client").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        names = imports(path)
        if any(n.split(".")[0] == "kvkeepd" for n in names) and rel != "client/kvkeep/cli/_daemon.py":
            errors.append(f"{rel}: the client imports the daemon")
        for name in names:
            allowed = CLIENT_RULES.get(name.split(".")[0])
            if allowed is not None and rel not in allowed:
                errors.append(f"{rel}: imports {name}")
    for path in sorted((ROOT / "daemon").rglob("*.py")):
        errors += hop_errors(module_of(path), ast.parse(path.read_text(), str(path)))
    graph = daemon_graph()
    errors += layer_errors(graph)
    errors += [f"a circle: {' -> '.join(c)}" for c in circles(graph)]
    for e in errors:
        print(f"import boundary: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
