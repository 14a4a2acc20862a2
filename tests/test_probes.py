"""The exactness probe's results are kept by everything that picks the kernels (probes.py):
a daemon started again on the same build, model, settings and machine reuses its result;
anything else that differs probes again, and a damaged or unwritable file costs a probe."""

from __future__ import annotations

import json
import logging
import stat
from pathlib import Path

import pytest
from daemons import InProcessDaemon, model_path

from kvkeepd.engine import probes
from kvkeepd.engine.context import ContextConfig

KEPT = "exactness probe: not run again, its result of"
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
    assert probes.cached(path, "a", first) == finding
    again = Prober(None)
    assert probes.cached(path, "a", again) == finding  # kept, not probed
    assert again.calls == 0 and first.calls == 1
    other = Prober(None)
    assert probes.cached(path, "b", other) is None and other.calls == 1
    assert set(json.loads(path.read_text())) == {"a", "b"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert probes.cached(None, "a", again) is None and again.calls == 1  # no file: probed


@pytest.mark.parametrize("damage", ["{not json", '["a list"]', '{"a": {"found": 7}}'])
def test_a_damaged_file_costs_a_probe(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "probes.json"
    path.write_text(damage)
    prober = Prober(None)
    assert probes.cached(path, "a", prober) is None and prober.calls == 1
    assert json.loads(path.read_text())["a"]["found"] is None  # written again, whole


def test_an_unwritable_place_only_costs_the_next_start_a_probe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    prober = Prober(None)
    with caplog.at_level(logging.WARNING, "kvkeepd.engine.probes"):
        assert probes.cached(blocker / "probes.json", "a", prober) is None
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
