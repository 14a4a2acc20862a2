"""Crash safety: SIGKILL at random moments while a large persistent session is saved.

A daemon (subprocess) holds a persistent session of more than 1,500 tokens. Each round, a
thread generates 4 tokens on it (its autosave writes the new blocks and a new head manifest)
and then takes explicit checkpoints back to back, until the daemon is killed with SIGKILL at a
random moment: 0-150 ms after the thread starts, 0-60 ms after the next-to-last token of the
generation arrives (inside the autosave, most likely), or 0-150 ms after the first explicit
checkpoint starts. After each restart:

- no unfinished block write is left behind (``blocks/tmp`` is empty);
- the session is listed, at the state of its last completed save, and continues exactly;
- every acknowledged checkpoint is listed, and the last one restores (into another session)
  and continues exactly like the tokens generated from the same state before the kill.

The expected continuation of each state is recorded before the kill, by forking the session
(an ephemeral copy; nothing on disk) and generating from the fork.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from checkpoint_helpers import SAMPLED, SPAWN_ARGS, Trace, gen, long_text
from daemons import DaemonProcess

import kvstash

ROUNDS = 22
LOOKAHEAD = 12  # tokens of expected continuation recorded per state
STEP = 4  # tokens the storm generates before its checkpoints


@dataclass
class Storm:
    """Generate STEP tokens, then checkpoint until the daemon dies."""

    address: str
    session_id: str
    label: str
    generated: Trace | None = None
    acked: list[kvstash.CheckpointInfo] = field(default_factory=list)
    saving: threading.Event = field(default_factory=threading.Event)
    first_checkpoint: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            with kvstash.Client(self.address, timeout=30) as client:
                session = client.session(self.session_id)
                got: Trace = []
                for chunk in session.generate("", max_tokens=STEP, logprobs=1):
                    got += [(t.sampled.token_id, t.sampled.logprob) for t in chunk.logprobs]
                    if chunk.finish_reason is None and len(got) == STEP - 1:
                        self.saving.set()  # the last token, then the autosave, then the reply
                    if chunk.finish_reason is not None:
                        assert chunk.finish_reason == "length"
                        self.generated = got
                for i in range(10_000):
                    self.first_checkpoint.set()
                    self.acked.append(session.checkpoint(f"{self.label}-{i}"))
        except kvstash.UnavailableError:
            pass  # the kill
        except kvstash.KvstashError as e:
            # A call cut off by the kill may also end as CANCELLED/UNKNOWN (InternalError).
            if not isinstance(e, kvstash.InternalError):
                self.error = e
        except BaseException as e:
            self.error = e
        finally:
            self.saving.set()
            self.first_checkpoint.set()


@pytest.mark.timeout(300)
def test_sigkill_during_checkpoints_never_loses_an_acknowledged_one(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    started = time.monotonic()
    proc = spawn_daemon(*SPAWN_ARGS, "--slots", "2", "--ctx-per-session", "2048")
    tmp_dir = proc.state_dir / "blocks" / "tmp"
    rng = random.Random(20240229)

    with kvstash.Client(proc.address, timeout=60) as client:
        s = client.create_session(sampling=SAMPLED, persistent=True)
        gen(s, long_text(95, "crash"), 1)
        assert s.info().n_tokens >= 1500
    session_id = s.session_id

    # n_tokens -> the tokens that follow that state. The session only ever grows, so its
    # length names its state.
    expected: dict[int, Trace] = {}
    acked: list[kvstash.CheckpointInfo] = []
    rounds_with_checkpoints = 0

    for round_ in range(ROUNDS):
        with kvstash.Client(proc.address, timeout=60) as client:
            n = client.session(session_id).info().n_tokens
            fork = client.fork_session(session_id)
            ahead = gen(fork, "", LOOKAHEAD)
            fork.close()
            if n in expected:  # the state the session came back in continues as recorded
                known = expected[n]
                assert ahead[: len(known)] == known, f"round {round_}: the head does not continue exactly"
            expected[n] = ahead
            expected[n + STEP] = ahead[STEP:]

        storm = Storm(proc.address, session_id, f"r{round_}")
        thread = threading.Thread(target=storm.run, name="storm", daemon=True)
        thread.start()
        if round_ % 3 == 0:  # anywhere: loading, generating, saving, checkpointing
            time.sleep(rng.uniform(0, 0.150))
        elif round_ % 3 == 1:  # inside the autosave of the generation, most likely
            storm.saving.wait(30)
            time.sleep(rng.uniform(0, 0.060))
        else:  # among the explicit checkpoints
            storm.first_checkpoint.wait(30)
            time.sleep(rng.uniform(0, 0.150))
        proc.kill()
        thread.join(30)
        assert not thread.is_alive()
        assert storm.error is None, f"round {round_}: {storm.error!r}"
        if storm.generated is not None:
            assert storm.generated == ahead[:STEP], f"round {round_}"
        rounds_with_checkpoints += bool(storm.acked)
        acked += storm.acked

        proc.start()
        assert list(tmp_dir.iterdir()) == [], f"round {round_}: unfinished block writes left"
        with kvstash.Client(proc.address, timeout=60) as client:
            assert session_id in {i.session_id for i in client.list_sessions()}
            session = client.session(session_id)
            n_after = session.info().n_tokens
            # The last completed save: after the storm's generation if it was acknowledged,
            # else before or after it (the kill may land between the save and the reply).
            assert n_after == n + STEP if storm.generated is not None else n_after in (n, n + STEP)
            listed = {c.checkpoint_id for c in session.checkpoints()}
            missing = [c.checkpoint_id for c in acked if c.checkpoint_id not in listed]
            assert not missing, f"round {round_}: acknowledged checkpoints lost: {missing}"
            if acked:
                last = acked[-1]
                scratch = client.create_session()
                info = scratch.restore(last.checkpoint_id)
                assert info.n_tokens == last.n_tokens
                follow = expected[last.n_tokens][:8]
                assert gen(scratch, "", len(follow)) == follow, (
                    f"round {round_}: checkpoint {last.checkpoint_id} does not continue exactly"
                )
                with contextlib.suppress(kvstash.KvstashError):
                    scratch.close()

    assert proc.starts == ROUNDS + 1
    assert acked, "no checkpoint was ever acknowledged before a kill"
    elapsed = time.monotonic() - started
    swept = proc.log().count("unfinished block writes")
    print(
        f"{ROUNDS} kills, {len(acked)} acknowledged checkpoints in {rounds_with_checkpoints} "
        f"rounds, {swept} restarts swept unfinished block writes, {elapsed:.0f} s"
    )
