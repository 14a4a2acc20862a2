"""The exactness probe's results are kept by everything that picks the kernels (probes.py):
a daemon started again on the same build, model, settings and machine reuses its result;
anything else that differs probes again, and a damaged or unwritable file costs a probe. A
kept entry that is not a result, or a finding the probe could not have reported, is ignored
with one warning: it never stops a start, nor turns exact mode off."""

from __future__ import annotations

import json
import logging
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemons import InProcessDaemon, model_path

from kvkeepd.engine import probes
from kvkeepd.engine.context_config import ContextConfig

KEPT = "exactness probe: not run again, its result of"
PROBED = "exactness probe: passed in"
IGNORED = "exactness probe: ignoring the result"


def any_finding(found: str) -> bool:
    return True


PROBE = {"tokens": 260, "chunks": [1, 36]}
BUILD = {"version": "0.3.36", "devices": [["CPU", "a CPU"]]}


def config(**changes: object) -> ContextConfig:
    fields = dict(
        model_path=model_path(), slots=4, ctx_per_session=1024, batch_size=512,
        threads=1, gpu_layers=0, kv_type="f16", kv_unified=False,
    )  # fmt: skip
    return ContextConfig(**{**fields, **changes})  # type: ignore[arg-type]


class Prober:
    """A stand-in for the probe's finding: counts how often it was asked."""

    def __init__(self, found: str | None) -> None:
        self.found, self.calls = found, 0

    def __call__(self) -> str | None:
        self.calls += 1
        return self.found


def test_the_key_follows_the_settings_and_the_probe() -> None:
    def key(cfg: ContextConfig, probe: dict[str, object] = PROBE, build: dict[str, object] = BUILD) -> str:
        return probes.machine_key(cfg, probe, build)

    same = key(config())
    assert same == key(config())
    others = [
        key(config(threads=2)),
        key(config(batch_size=256)),
        key(config(slots=1)),
        key(config(), probe={**PROBE, "tokens": 261}),
        key(config(), build={**BUILD, "devices": [["CPU", "a CPU"], ["CUDA0", "a GPU"]]}),
    ]
    assert len({same, *others}) == 6


def test_a_kept_result_is_reused_and_another_key_probes(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "probes.json"
    finding = "position 36 evaluated in a chunk of 36 has logits up to 0.685 away"
    first = Prober(finding)
    assert probes.cached(path, "a", first, any_finding) == finding
    again = Prober(None)
    assert probes.cached(path, "a", again, any_finding) == finding  # kept, not probed
    assert again.calls == 0 and first.calls == 1
    other = Prober(None)
    assert probes.cached(path, "b", other, any_finding) is None and other.calls == 1
    assert set(json.loads(path.read_text())) == {"a", "b"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert probes.cached(None, "a", again, any_finding) is None and again.calls == 1  # no file: probed


@pytest.mark.parametrize("damage", ["{not json", '["a list"]', '{"a": {"found": 7}}'])
def test_a_damaged_file_costs_a_probe(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "probes.json"
    path.write_text(damage)
    prober = Prober(None)
    assert probes.cached(path, "a", prober, any_finding) is None and prober.calls == 1
    assert json.loads(path.read_text())["a"]["found"] is None  # written again, whole


def test_an_unwritable_place_only_costs_the_next_start_a_probe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    prober = Prober(None)
    with caplog.at_level(logging.WARNING, "kvkeepd.engine.probes"):
        assert probes.cached(blocker / "probes.json", "a", prober, any_finding) is None
    assert prober.calls == 1 and "cannot keep the exactness probe's result" in caplog.text


def test_a_daemon_started_again_reuses_its_probe_whatever_its_state_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default place is the user's cache directory: a second start, on a new state
    directory, finds the first's result there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for start in range(2):
        with caplog.at_level(logging.INFO, "kvkeepd.engine.probes"):
            caplog.clear()
            d = InProcessDaemon.with_settings(
                tmp_path / f"state{start}", slots=2, ctx_per_session=512, probe_cache=""
            )
            try:
                assert d.daemon is not None and d.daemon.engine.info is not None
                assert d.daemon.engine.info.exact
            finally:
                d.stop()
        assert (KEPT in caplog.text) == (start == 1)
        assert ("exactness probe: passed in" in caplog.text) == (start == 0)
    kept = json.loads((tmp_path / "cache" / "kvkeep" / "probes.json").read_text())
    assert [e["found"] for e in kept.values()] == [None]
    assert not (tmp_path / "state0" / "probes.json").exists()


# The settings of the daemons below, and a finding the probe could report for them (its
# second chunk, of 36 tokens, ends at position 36).
# Exact mode without flash attention: one probe, one key (exact mode's flash attention, probed
# first where it is asked for, is tests/daemon/test_exact_flash.py's).
SETTINGS: dict[str, Any] = {"slots": 2, "ctx_per_session": 512, "exact_attention": "plain"}
REAL_FINDING = (
    "position 36 evaluated in a chunk of 36 (after chunks of [1]) has logits up to 0.685 away "
    "from those of one chunk of 260"
)


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The key and the entry a daemon of SETTINGS keeps: a real start, a real probe."""
    path = tmp_path_factory.mktemp("probes") / "probes.json"
    InProcessDaemon.with_settings(tmp_path_factory.mktemp("state"), probe_cache=str(path), **SETTINGS).stop()
    ((key, entry),) = json.loads(path.read_text()).items()
    assert entry["found"] is None  # this build is exact on this CPU
    return key, entry


def start(
    start_daemon: Callable[..., InProcessDaemon], path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[InProcessDaemon, list[str]]:
    """A daemon of SETTINGS on the probe cache `path`, and the probe's warning lines."""
    with caplog.at_level(logging.INFO, "kvkeepd.engine.probes"):
        caplog.clear()
        d = start_daemon(probe_cache=str(path), **SETTINGS)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvkeepd.engine.probes" and r.levelno >= logging.WARNING
    ]
    return d, warnings


# An entry planted under the daemon's own key (from the real one), and why it is ignored.
PLANTED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "at-not-a-time": (lambda e: {**e, "at": "abc"}, """'at' is not a time: "abc\""""),
    "at-past-the-clock": (lambda e: {**e, "at": 1e300}, "'at' is not a time: 1e+300"),
    "at-missing": (lambda e: {"found": None}, "'at' is not a time: null"),
    "found-a-number": (lambda e: {**e, "found": 7}, "'found' is neither null nor a string: 7"),
    "found-missing": (lambda e: {"at": e["at"]}, "'found' is neither null nor a string: null"),
    "a-list": (lambda e: [None, e["at"]], "not an object: [null, {}]"),
    "a-forged-finding": (
        lambda e: {**e, "found": "kernels differ"},
        """a finding this probe does not report: "kernels differ\"""",
    ),
    "a-position-not-probed": (
        lambda e: {**e, "found": REAL_FINDING.replace("position 36", "position 37")},
        "a finding this probe does not report: "
        + json.dumps(REAL_FINDING.replace("position 36", "position 37"))[:77]
        + "...",
    ),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_an_entry_that_is_not_a_result_is_ignored_with_one_warning_and_probed_again(
    tmp_path: Path,
    kept: tuple[str, dict[str, Any]],
    start_daemon: Callable[..., InProcessDaemon],
    caplog: pytest.LogCaptureFixture,
    planted: str,
) -> None:
    key, entry = kept
    plant, why = PLANTED[planted]
    path = tmp_path / "probes.json"
    path.write_text(json.dumps({key: plant(entry), "another": {"found": None, "at": 1}}))
    d, warnings = start(start_daemon, path, caplog)
    assert warnings == [
        f"{IGNORED} kept for these settings in {path} ({why.format(json.dumps(entry['at']))}); probing again"
    ]
    assert PROBED in caplog.text and KEPT not in caplog.text
    assert d.daemon is not None and d.daemon.engine.info is not None and d.daemon.engine.info.exact
    again = json.loads(path.read_text())
    assert again[key]["found"] is None and set(again) == {key, "another"}


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda text: text[: len(text) // 2], "not JSON: "),
        (lambda text: "[1, 2]", "not a JSON object"),
        (lambda text: "\xff\xfe", "not JSON: "),
    ],
)
def test_a_damaged_file_is_ignored_with_one_warning_and_probed_again(
    tmp_path: Path,
    kept: tuple[str, dict[str, Any]],
    start_daemon: Callable[..., InProcessDaemon],
    caplog: pytest.LogCaptureFixture,
    damage: Callable[[str], str],
    why: str,
) -> None:
    key, entry = kept
    path = tmp_path / "probes.json"
    path.write_bytes(damage(json.dumps({key: entry}, indent=1)).encode("latin-1"))
    d, warnings = start(start_daemon, path, caplog)
    assert len(warnings) == 1 and warnings[0].startswith(
        f"exactness probe: ignoring the results kept in {path} ({why}"
    )
    assert warnings[0].endswith("); probing again") and "\n" not in warnings[0]
    assert PROBED in caplog.text
    assert d.daemon is not None and d.daemon.engine.info is not None and d.daemon.engine.info.exact
    assert json.loads(path.read_text())[key]["found"] is None


def test_a_finding_the_probe_reports_is_trusted_to_turn_exact_mode_off(
    tmp_path: Path,
    kept: tuple[str, dict[str, Any]],
    start_daemon: Callable[..., InProcessDaemon],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The other side of the check: a finding of the form and at a position the probe
    reports for these settings is kept, and the daemon starts in the compact mode."""
    key, entry = kept
    path = tmp_path / "probes.json"
    path.write_text(json.dumps({key: {**entry, "found": REAL_FINDING}}))
    d, warnings = start(start_daemon, path, caplog)
    assert KEPT in caplog.text and PROBED not in caplog.text
    assert warnings == [f"a token's logits depend on how it was batched: {REAL_FINDING}"]
    info = d.daemon.engine.info if d.daemon is not None else None
    assert info is not None and not info.exact and info.exact_note == REAL_FINDING
