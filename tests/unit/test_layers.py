"""The house's rules, checked: layers, no circles, light value modules, one wire vocabulary.

- The daemon's import graph (every import, TYPE_CHECKING and function-level ones included)
  follows scripts/check_imports.py's layers and has no circle; the checker itself catches
  an upward import and a circle.
- The byte formats and values import no engine: `kvkeepd.state.manifest` and the modules of
  `kvkeepd.values` load without jinja2, llguidance or llama_cpp.
- The client and the daemon agree on the wire: the metadata keys, and every error cause with
  its status.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import grpc
import pytest

import kvkeep
from kvkeep import _connection as client_connection
from kvkeep import _errors as client_errors
from kvkeepd import errors as daemon_errors
from kvkeepd.api import service

ROOT = Path(__file__).resolve().parents[2]


def check_imports() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_daemon_follows_its_layers_without_circles() -> None:
    checker = check_imports()
    graph = checker.daemon_graph()
    assert "kvkeepd.sessions.flows.generation" in graph  # the graph is the real one
    assert checker.layer_errors(graph) == []
    assert checker.circles(graph) == []


def test_the_checker_catches_an_upward_import_and_a_circle() -> None:
    checker = check_imports()
    graph = {
        "kvkeepd.state.manifest": {"kvkeepd.engine.structured_output"},  # up a layer
        "kvkeepd.engine.structured_output": set(),
        "kvkeepd.sessions.memory.prefix_cache": {"kvkeepd.sessions.manager"},  # the manager, not a host
        "kvkeepd.sessions.manager": {"kvkeepd.sessions.memory.prefix_cache"},  # ...and a circle
        "kvkeepd.config.settings": {"kvkeepd.state.layout"},  # sideways
        "kvkeepd.state.layout": set(),
    }
    errors = checker.layer_errors(graph)
    assert any("kvkeepd.state.manifest" in e and "upward" in e for e in errors)
    assert any("kvkeepd.config.settings" in e and "sideways" in e for e in errors)
    assert any("kvkeepd.sessions.memory.prefix_cache imports the session manager" in e for e in errors)
    assert checker.circles(graph) == [["kvkeepd.sessions.manager", "kvkeepd.sessions.memory.prefix_cache"]]


def test_the_checker_holds_the_rooms_inside_sessions() -> None:
    checker = check_imports()
    graph = {
        # The vocabulary reaching up into a flow, durability into memory, and prompting sideways
        # into durability: each breaks the rooms' order.
        "kvkeepd.sessions.placement": {"kvkeepd.sessions.flows.generation"},
        "kvkeepd.sessions.durability.persistence": {"kvkeepd.sessions.memory.residency"},
        "kvkeepd.sessions.prompting.fitting": {"kvkeepd.sessions.durability.leases"},
        # Down the rooms, and inside one, is allowed.
        "kvkeepd.sessions.flows.generation": {
            "kvkeepd.sessions.flows.head_saves",
            "kvkeepd.sessions.memory.residency",
            "kvkeepd.sessions.prompting.tokens",
            "kvkeepd.sessions.session",
        },
        "kvkeepd.sessions.manager": {"kvkeepd.sessions.flows.generation"},
        "kvkeepd.sessions.flows.head_saves": set(),
        "kvkeepd.sessions.memory.residency": set(),
        "kvkeepd.sessions.prompting.tokens": set(),
        "kvkeepd.sessions.session": set(),
        "kvkeepd.sessions.durability.leases": set(),
    }
    errors = checker.layer_errors(graph)
    assert len(errors) == 3, errors
    assert any(e.startswith("kvkeepd.sessions.placement ") and "upward" in e for e in errors)
    assert any(e.startswith("kvkeepd.sessions.durability.persistence ") for e in errors)
    assert any(e.startswith("kvkeepd.sessions.prompting.fitting ") and "sideways" in e for e in errors)


def test_the_checker_keeps_the_doors_one_hop_from_the_manager() -> None:
    checker = check_imports()
    code = (
        "async def handler(self, tenant):\n"
        "    await self.manager.checkpoints.restore('s', 'c', tenant)\n"  # a part's method
        "    flows = self.manager._responses\n"  # a private part
        "    await self.manager.restore('s', 'c', tenant)\n"  # the façade: allowed
        "    return self.manager.settings.slots\n"  # a value: allowed
    )
    tree = ast.parse(code)
    errors = checker.hop_errors("kvkeepd.api.service", tree)
    where = sorted(e.split(" reaches")[0] for e in errors)
    assert where == ["kvkeepd.api.service:2", "kvkeepd.api.service:3"]
    assert checker.hop_errors("kvkeepd.sessions.manager", tree) == []  # its own parts


VALUES = [
    f"kvkeepd.values.{name}" for name in ("messages", "sampling", "constraints", "generation", "toolcall")
]


@pytest.mark.parametrize("module", ["kvkeepd.state.manifest", *VALUES, "kvkeepd.storage.exports"])
def test_formats_and_values_import_no_engine(module: str) -> None:
    heavy = ("jinja2", "llguidance", "llama_cpp")
    code = f"import sys, {module}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_client_and_the_daemon_agree_on_the_wire() -> None:
    assert client_connection.SESSION_HEADER == service.SESSION_HEADER
    assert client_errors.CAUSE_KEY == daemon_errors.CAUSE_KEY
    assert client_errors.RETRY_KEY == daemon_errors.RETRY_KEY
    assert client_errors.INTERNAL_CAUSE == daemon_errors.INTERNAL_CAUSE

    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    daemon_causes = {c.cause: c.code for c in subclasses(daemon_errors.KvkeepError) if c.cause}
    client_causes = {cause: cls for cause, cls in client_errors._BY_CAUSE.items()}
    assert set(daemon_causes) == set(client_causes)
    for cause, code in daemon_causes.items():
        # The client's class for a cause is the one its status maps to, or a subclass of it.
        by_status = client_errors._BY_STATUS[grpc.StatusCode[code]]
        assert issubclass(client_causes[cause], by_status), cause
    # Every status the daemon sends has a client class of its own.
    codes = {c.code for c in subclasses(daemon_errors.KvkeepError)} - {"INTERNAL"}
    assert all(grpc.StatusCode[code] in client_errors._BY_STATUS for code in codes)
    assert issubclass(client_errors.InternalError, kvkeep.KvkeepError)
