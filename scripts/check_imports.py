"""Import boundaries: who may import llama_cpp, grpc and kvkeepd."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = {
    # module prefix -> files (relative to the package) allowed to import it
    "llama_cpp": {"daemon/kvkeepd/engine/context.py"},
    "grpc": {"daemon/kvkeepd/api/service.py", "daemon/kvkeepd/server.py"},
    "grpc_health": {"daemon/kvkeepd/server.py"},
    "grpc_reflection": {"daemon/kvkeepd/server.py"},
    # The HTTP door's stack (an optional extra) stays inside its package.
    "starlette": {"daemon/kvkeepd/api/http/app.py"},
    "uvicorn": {"daemon/kvkeepd/api/http/door.py", "daemon/kvkeepd/api/http/guard.py"},
    "pydantic": {"daemon/kvkeepd/api/http/app.py", "daemon/kvkeepd/api/http/schema.py"},
}
# The same for the SDK: LangChain (an optional extra) only in its integration.
CLIENT_RULES = {
    "langchain_core": {"client/kvkeep/integrations/langchain.py"},
}


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
    for e in errors:
        print(f"import boundary: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
