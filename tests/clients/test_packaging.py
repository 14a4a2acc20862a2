"""kvkeep installs from what `scripts/dist` builds: the sdist and the wheel hold every module,
the typed markers, the stubs, the license and complete metadata, and the wheel installed into
a fresh virtual environment gives a working `kvkeep` (the CLI, then `kvkeep serve` and
`kvkeep info` against it).

Offline: the build uses setuptools from .venv, and the wheel is installed with --no-deps
--no-index. The fresh environment reaches its dependencies (grpcio, click, llama-cpp-python,
the embedded model...) through a .pth line naming .venv's site-packages, as if pip had
installed them there; kvkeep itself is the wheel's copy, which the test checks.
"""

from __future__ import annotations

import email
import email.message
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import PROBE_CACHE, model_path, wait_until

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"


def modules(package_dir: Path) -> set[str]:
    """The package's Python files and stubs in the tree, as paths inside the wheel."""
    return {
        str(p.relative_to(package_dir.parent))
        for p in package_dir.rglob("*")
        if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [str(ROOT / "scripts" / "dist"), str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    sdist, wheel = (Path(line) for line in done.stdout.split())
    assert sdist == out / f"kvkeep-{VERSION}.tar.gz" and wheel == out / f"kvkeep-{VERSION}-py3-none-any.whl"
    return sdist, wheel


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        return email.message_from_string(z.read(f"kvkeep-{VERSION}.dist-info/METADATA").decode())


def test_the_wheel_holds_every_module_and_marker(built: tuple[Path, Path]) -> None:
    _, wheel = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(f"kvkeep-{VERSION}.dist-info/entry_points.txt").decode()
    expected = modules(ROOT / "client" / "kvkeep") | modules(ROOT / "daemon" / "kvkeepd")
    assert expected - names == set()
    assert {"kvkeep/py.typed", "kvkeepd/py.typed", "kvkeep/v1/kvkeep_pb2.pyi"} <= names
    # The console's page ships as its files are in the tree.
    console = ROOT / "daemon" / "kvkeepd" / "api" / "http" / "console" / "static"
    shipped = {f"kvkeepd/api/http/console/static/{f.name}" for f in console.iterdir()}
    assert {
        "kvkeepd/api/http/console/static/index.html",
        "kvkeepd/api/http/console/static/console.js",
    } <= shipped
    assert shipped <= names
    assert f"kvkeep-{VERSION}.dist-info/licenses/LICENSE" in names
    # Only the two packages: no tests, scripts or build leftovers.
    assert {n.split("/")[0] for n in names} == {"kvkeep", "kvkeepd", f"kvkeep-{VERSION}.dist-info"}
    assert "kvkeep = kvkeep.cli:main" in entry_points and "kvkeepd = kvkeepd.cli:main" in entry_points


def test_the_metadata_is_complete_for_an_index(built: tuple[Path, Path]) -> None:
    meta = metadata(built[1])
    assert meta["Name"] == "kvkeep" and meta["Version"] == VERSION
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Requires-Python"] == ">=3.11"
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.11" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    requires = meta.get_all("Requires-Dist") or []
    assert any(r.startswith("grpcio") and "extra" not in r for r in requires)
    assert any(r.startswith("llama-cpp-python==") and 'extra == "daemon"' in r for r in requires)
    assert {"daemon", "s3", "langchain"} <= set(meta.get_all("Provides-Extra") or [])


def test_the_sdist_builds_the_wheel_again(built: tuple[Path, Path]) -> None:
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for path in ("pyproject.toml", "README.md", "LICENSE", "PKG-INFO", "client/kvkeep/py.typed"):
        assert path in names
    assert {f"client/{m}" for m in modules(ROOT / "client" / "kvkeep")} <= names
    assert {f"daemon/{m}" for m in modules(ROOT / "daemon" / "kvkeepd")} <= names


@pytest.fixture(scope="module")
def installed(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtual environment with the wheel installed; its bin/ folder."""
    env = tmp_path_factory.mktemp("fresh") / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(built[1]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # The dependencies, as pip would have installed them from an index.
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield env / "bin"


def test_the_installed_wheel_is_the_kvkeep_that_runs(installed: Path) -> None:
    where = subprocess.run(
        [str(installed / "python"), "-c", "import kvkeep, kvkeepd; print(kvkeep.__file__, kvkeepd.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(w).is_relative_to(installed.parent) for w in where), where
    shown = subprocess.run([str(installed / "kvkeep"), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "serve" in shown.stdout and "session" in shown.stdout


def test_the_installed_wheel_serves_and_answers_info(installed: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    log = tmp_path / "daemon.log"
    command = [str(installed / "kvkeep"), "serve", "--model", str(model_path()), "--address", "127.0.0.1:0"]
    command += ["--http", "off", "--ready-file", str(ready), "--state-dir", str(tmp_path / "state")]
    command += ["--threads", "1", "--probe-cache", str(PROBE_CACHE)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:

        def port() -> str | None:
            assert proc.poll() is None, log.read_text()
            text = ready.read_text() if ready.exists() else ""
            return text.strip() if text.endswith("\n") else None

        address = f"127.0.0.1:{wait_until(port, 120, 'the ready file')}"
        info = subprocess.run(
            [str(installed / "kvkeep"), "info", "--address", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert info.returncode == 0, info.stderr
        assert "engine:" in info.stdout
    finally:
        proc.terminate()
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()
