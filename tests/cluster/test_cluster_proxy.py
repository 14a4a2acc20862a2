"""A cluster as it is deployed: two daemons sharing a Redis catalog and block store behind
HAProxy running deploy/haproxy.cfg itself, TLS (and the callers' bearer tokens) from the
proxy to the daemons, health checks over TLS; and the SDK following a session through the
proxy when its daemon is killed: it sends its calls again until the other daemon has taken
the session over, and goes on with exactly the tokens the first would have given.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
import tlscerts
from daemons import DaemonProcess, wait_until
from servers import HaproxyServer, free_port

import kvkeep

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
TOKEN = "cluster-tenant-token-0123456789"
SAMPLING = kvkeep.SamplingParams(seed=77)
SYSTEM = "You are a librarian. You answer questions about opening hours and loans in one sentence."


def test_the_sdk_follows_a_session_through_a_tls_proxy_when_its_daemon_is_killed(
    spawn_daemon: Callable[..., DaemonProcess],
    start_haproxy: Callable[..., HaproxyServer],
    redis_server: str,
    tmp_path: Path,
) -> None:
    certs = tlscerts.make(tmp_path)
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[tenants.library]\ntokens = ["{TOKEN}"]\n')
    common = (
        "--catalog", f"{redis_server}?prefix=cluster-{secrets.token_hex(6)}",
        "--store", redis_server,
        "--lease-seconds", "1.5",
        "--tls-cert", str(certs.server.cert),
        "--tls-key", str(certs.server.key),
        "--auth-file", str(auth),
    )  # fmt: skip
    env = {"KVKEEP_STORE_KEY": secrets.token_hex(32)}
    daemons = [
        spawn_daemon(*common, "--daemon-name", name, env=env, tls_ca=certs.ca) for name in ("one", "two")
    ]
    address = f"127.0.0.1:{free_port()}"
    proxy_env = {
        "KVKEEP_PROXY_ADDRESS": address,
        "KVKEEP_DAEMON_1": daemons[0].address,
        "KVKEEP_DAEMON_2": daemons[1].address,
        "KVKEEP_DAEMON_CA": str(certs.ca),
    }

    def answers() -> bool:
        with kvkeep.Client(address, timeout=2, token=TOKEN, retry=None) as probe:
            try:
                return probe.info().slots > 0
            except kvkeep.KvkeepError:
                return False

    proxy = start_haproxy(CONFIG, proxy_env, answers)
    with kvkeep.Client(address, timeout=60, token=TOKEN) as client:
        with kvkeep.Client(address, timeout=10, retry=None) as stranger, pytest.raises(kvkeep.AuthError):
            stranger.info()  # the token is the daemons' to check, through the proxy
        s = client.create_session(SYSTEM, persistent=True, sampling=SAMPLING)
        s.chat("When do you open?", max_tokens=8)
        expected = s.fork().chat("Can I renew a loan?", max_tokens=12)  # what its daemon would say
        holder = {i.session_id: i.holder for i in client.list_sessions()}[s.session_id]
        victim = daemons[0] if holder == "one" else daemons[1]
        survivor = daemons[1] if victim is daemons[0] else daemons[0]
        # Both are checked over TLS every second: neither was ever taken out.
        assert "is DOWN" not in proxy.log()

        victim.kill()
        # Through the proxy: the dead daemon's connection fails, then the survivor answers
        # session-elsewhere until the lease lapses; the client sends the turn again each time.
        got = s.chat("Can I renew a loan?", max_tokens=12)
        assert got.token_ids == expected.token_ids
        assert f"session {s.session_id} taken over" in survivor.log()
        wait_until(lambda: "is DOWN" in proxy.log(), 20, "the proxy to take the dead daemon out")
        listed = {i.session_id: i for i in client.list_sessions()}[s.session_id]
        assert listed.holder == ("two" if victim is daemons[0] else "one")
