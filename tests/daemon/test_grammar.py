"""Structured output: GBNF grammars and JSON schemas, against a real daemon and model.

What is checked: the output parses under its grammar (a parser written here) or validates
under its schema (jsonschema); the same seed gives the same output at temperature > 0; a
constrained output cut short continues within the grammar, and the same as an uninterrupted
run, after a checkpoint is restored, in a fork, and after kill -9 of a persistent session;
bad grammars and schemas get INVALID_ARGUMENT and leave the daemon serving, and so does a
constraint from an imported checkpoint that does not compile or does not match its output.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from checkpoint_helpers import SPAWN_ARGS, edit_export, edit_manifest, export_bytes, remac
from click.testing import CliRunner
from daemons import DaemonProcess, InProcessDaemon, wait_until

import kvkeep
from kvkeep.cli import main
from kvkeepd.errors import CorruptCheckpoint
from kvkeepd.request_limits import MAX_GRAMMAR_CHARS
from kvkeepd.state.manifest import Snapshot, decode, encode
from kvkeepd.values.constraints import Constraint, GrammarSpec
from kvkeepd.values.sampling import SamplingParams

# A context-free language (nested parentheses), so that no regular expression could check it.
ARITHMETIC = r"""
root ::= expr " = " num
expr ::= term ((" + " | " * ") term){0,3}
term ::= num | "(" expr ")"
num  ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_PROMPT = "Arithmetic practice, one exercise per line.\n"

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}

HOT = kvkeep.SamplingParams(temperature=0.9, seed=4242)
# Enough for any output of ARITHMETIC this model writes: a test fails if one does not end.
LIMIT = 300


class ArithmeticParser:
    """Recursive descent over ARITHMETIC; `matches` is True for a whole sentence of it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    @classmethod
    def matches(cls, text: str) -> bool:
        p = cls(text)
        return p.expr() and p.literal(" = ") and p.num() and p.at == len(text)

    def literal(self, s: str) -> bool:
        if self.text.startswith(s, self.at):
            self.at += len(s)
            return True
        return False

    def num(self) -> bool:
        m = re.compile(r"[1-9][0-9]{0,2}").match(self.text, self.at)
        if m is None:
            return False
        self.at = m.end()
        return True

    def term(self) -> bool:
        if self.literal("("):
            return self.expr() and self.literal(")")
        return self.num()

    def expr(self) -> bool:
        if not self.term():
            return False
        for _ in range(3):
            if not (self.literal(" + ") or self.literal(" * ")):
                break
            if not self.term():
                return False
        return True


def test_the_parser_rejects_what_the_grammar_does() -> None:
    assert ArithmeticParser.matches("(12 + 3) * 4 = 51")
    for wrong in ("(12 + 3 = 5", "1 + 2 + 3 + 4 + 5 = 6", "01 = 1", "1 = 1 ", "1 - 2 = 3"):
        assert not ArithmeticParser.matches(wrong), wrong


def finish(session: kvkeep.Session, first: kvkeep.Completion) -> tuple[list[int], str]:
    """The whole constrained output: `first`, continued with empty prompts until it ends."""
    tokens, text, last = list(first.token_ids), first.text, first
    while last.finish_reason == "length" and len(tokens) < LIMIT:
        last = session.complete("", max_tokens=64)
        tokens += last.token_ids
        text += last.text
    assert last.finish_reason == "eos", (last.finish_reason, text)
    return tokens, text


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gbnf_output_parses(client: kvkeep.Client, seed: int) -> None:
    s = client.create_session(sampling=kvkeep.SamplingParams(temperature=0.9, seed=seed))
    try:
        _, text = finish(s, s.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=64))
        assert ArithmeticParser.matches(text), text
    finally:
        s.close()


@pytest.mark.parametrize("seed", [5, 6])
def test_json_schema_output_validates(client: kvkeep.Client, seed: int) -> None:
    s = client.create_session(
        "You describe users of a system as JSON.", sampling=kvkeep.SamplingParams(temperature=0.9, seed=seed)
    )
    try:
        reply = s.chat("Describe one user.", json_schema=PERSON, max_tokens=LIMIT)
        assert reply.finish_reason == "eos", reply.text
        jsonschema.validate(json.loads(reply.text), PERSON)
        # Structured output ends the turn: the next one is ordinary chat.
        assert s.chat("Thanks.", max_tokens=4).text
    finally:
        s.close()


def test_a_schema_given_as_json_text_works_like_the_dict(client: kvkeep.Client) -> None:
    texts = []
    for schema in (PERSON, json.dumps(PERSON)):
        s = client.create_session("Answer in JSON.", sampling=HOT)
        texts.append(s.chat("A user, please.", json_schema=schema, max_tokens=LIMIT).text)
        s.close()
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[0]), PERSON)


def test_same_seed_same_output(client: kvkeep.Client) -> None:
    outputs = []
    for _ in range(2):
        s = client.create_session(sampling=HOT)
        outputs.append(finish(s, s.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=LIMIT)))
        s.close()
    assert outputs[0] == outputs[1]
    assert ArithmeticParser.matches(outputs[0][1])


def test_cut_short_output_continues_after_restore_and_in_a_fork(client: kvkeep.Client) -> None:
    ref = client.create_session(sampling=HOT)
    whole = ref.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=LIMIT)
    ref.close()
    assert whole.finish_reason == "eos" and len(whole.token_ids) >= 6, whole.text
    k = len(whole.token_ids) // 2

    s = client.create_session(sampling=HOT)
    try:
        part = s.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=k)
        assert part.finish_reason == "length"
        ck = s.checkpoint("mid-output")
        rest = s.complete("", max_tokens=LIMIT)  # no grammar given: the open one continues
        assert rest.finish_reason == "eos"
        assert list(part.token_ids) + list(rest.token_ids) == list(whole.token_ids)
        assert ArithmeticParser.matches(part.text + rest.text)

        s.restore(ck.checkpoint_id)
        again = s.complete("", grammar=ARITHMETIC, max_tokens=LIMIT)  # the same grammar again
        assert again.token_ids == rest.token_ids

        fork = s.fork(ck.checkpoint_id)
        assert fork.complete("", max_tokens=LIMIT).token_ids == rest.token_ids
        fork.close()
    finally:
        s.close()


def test_sessions_swapped_out_mid_output_continue_within_their_grammars(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=1)
    with kvkeep.Client(d.address, timeout=60) as client:
        grammars = {"gbnf": {"grammar": ARITHMETIC}, "schema": {"json_schema": PERSON}}
        refs = {}
        for name, options in grammars.items():
            ref = client.create_session(sampling=HOT)
            refs[name] = ref.complete(ARITHMETIC_PROMPT, max_tokens=LIMIT, **options)
            ref.close()
        sessions = {name: client.create_session(sampling=HOT) for name in grammars}
        parts = {}
        for name, options in grammars.items():  # each evicts the other from the one slot
            parts[name] = sessions[name].complete(ARITHMETIC_PROMPT, max_tokens=4, **options)
        for name in grammars:
            rest = sessions[name].complete("", max_tokens=LIMIT)
            assert list(parts[name].token_ids) + list(rest.token_ids) == list(refs[name].token_ids)
        assert ArithmeticParser.matches(refs["gbnf"].text)
        jsonschema.validate(json.loads(refs["schema"].text), PERSON)


def test_exported_mid_output_the_constraint_travels_and_is_checked_on_use(
    client: kvkeep.Client, tmp_path: Path
) -> None:
    s = client.create_session(sampling=HOT)
    try:
        part = s.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=5)
        assert part.finish_reason == "length"
        data = export_bytes(client, s.checkpoint().checkpoint_id, tmp_path / "mid.kvs")
        expected = s.complete("", max_tokens=LIMIT)
    finally:
        s.close()

    def imported(edit: Callable[[dict[str, Any]], None] | None) -> kvkeep.Session:
        path = tmp_path / "edited.kvs"
        path.write_bytes(edit_export(data, edit) if edit is not None else data)
        return client.fork_session(checkpoint_id=client.import_checkpoint(path).checkpoint_id)

    same = imported(None)
    assert same.complete("", max_tokens=LIMIT).token_ids == expected.token_ids
    same.close()

    def other_grammar(meta: dict[str, Any]) -> None:
        meta["constraint"]["text"] = 'root ::= "zzz"'

    def broken_grammar(meta: dict[str, Any]) -> None:
        meta["constraint"]["text"] = "root ::= missing"

    for edit, message in ((other_grammar, "does not match its grammar"), (broken_grammar, "invalid")):
        forged = imported(edit)
        with pytest.raises(kvkeep.InvalidRequestError, match=message):
            forged.complete("", max_tokens=4)
        assert forged.complete(" and so on", max_tokens=2).token_ids  # a prompt starts afresh
        forged.close()


def test_a_cancelled_constrained_stream_continues_as_if_uninterrupted(client: kvkeep.Client) -> None:
    # At least 40 lines: the output cannot end before the cancel lands.
    lines = r'root ::= ("- " [a-z]+ (" " [a-z]+){2,} "." "\n"){40,}'
    n = 120
    ref = client.create_session(sampling=HOT)
    whole = ref.complete("Notes:\n", grammar=lines, max_tokens=n)
    ref.close()
    assert whole.finish_reason == "length" and whole.usage is not None
    s = client.create_session(sampling=HOT)
    try:
        seen: list[int] = []
        stream = s.generate("Notes:\n", grammar=lines, max_tokens=n)
        for chunk in stream:
            seen += chunk.token_ids
            if len(seen) >= 2:
                break
        stream.close()  # cancels: the daemon stops within a step
        rest = s.complete("", max_tokens=n)  # waits for the cancelled job's end
        generated = s.info().n_tokens - whole.usage.prompt_tokens - len(rest.token_ids)
        assert len(seen) <= generated < n
        assert seen == list(whole.token_ids[: len(seen)])
        assert list(rest.token_ids[: n - generated]) == list(whole.token_ids[generated:])
    finally:
        s.close()


def test_a_cut_short_chat_reply_continues_into_the_same_message(client: kvkeep.Client) -> None:
    s = client.create_session("You describe users of a system as JSON.", sampling=HOT)
    try:
        part = s.chat("Describe one user.", json_schema=PERSON, max_tokens=8)
        assert part.finish_reason == "length"
        rest = s.complete("", max_tokens=LIMIT)
        assert rest.finish_reason == "eos"
        jsonschema.validate(json.loads(part.text + rest.text), PERSON)
        assert s.info().messages[-1].content == part.text + rest.text
    finally:
        s.close()


def test_a_prompt_closes_an_open_constraint(client: kvkeep.Client) -> None:
    # Only digits, forever: cut short, it stays open until a request gives a prompt.
    digits = 'root ::= [0-9]+ "!"'
    s = client.create_session(sampling=kvkeep.SamplingParams(temperature=0.0))
    try:
        assert re.fullmatch(r"[0-9]+", s.complete("Count: ", grammar=digits, max_tokens=3).text)
        assert re.fullmatch(r"[0-9]+", s.complete("", max_tokens=3).text)
        free = s.complete(" and then the words", max_tokens=12).text
        assert not re.fullmatch(r"[0-9!]*", free), free
    finally:
        s.close()


def test_a_rewind_before_the_output_began_drops_the_constraint(client: kvkeep.Client) -> None:
    digits = 'root ::= [0-9]+ "!"'
    s = client.create_session(sampling=kvkeep.SamplingParams(temperature=0.0))
    try:
        s.complete("Count: ", grammar=digits, max_tokens=3)
        start = s.info().n_tokens - 3
        s.rewind(start + 1)  # inside the output: it stays open
        assert re.fullmatch(r"[0-9]+", s.complete("", max_tokens=3).text)
        s.rewind(start - 1)  # before it: gone
        free = s.complete("", max_tokens=12).text
        assert not re.fullmatch(r"[0-9!]*", free), free
    finally:
        s.close()


def test_async_client(daemon_address: str) -> None:
    async def run() -> str:
        async with kvkeep.AsyncClient(daemon_address, timeout=30) as client:
            s = await client.create_session("Answer in JSON.", sampling=HOT)
            stream = s.chat_stream("A user, please.", json_schema=PERSON, max_tokens=LIMIT)
            parts = [c.text async for c in stream]
            await s.close()
            return "".join(parts)

    jsonschema.validate(json.loads(asyncio.run(run())), PERSON)


def test_cli_run_with_a_json_schema(daemon_address: str, tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    args = ["run", "Describe one user.", "--seed", "3", "--json-schema", str(schema)]
    result = CliRunner().invoke(main, ["--address", daemon_address, *args])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.output), PERSON)


def test_cli_run_with_a_grammar(daemon_address: str, tmp_path: Path) -> None:
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text(ARITHMETIC)
    args = ["run", "Write one sum.", "--seed", "4", "--max-tokens", str(LIMIT), "--grammar", str(grammar)]
    result = CliRunner().invoke(main, ["--address", daemon_address, *args])
    assert result.exit_code == 0, result.output
    assert ArithmeticParser.matches(result.output.rstrip("\n")), result.output
    both = CliRunner().invoke(main, ["--address", daemon_address, *args, "--json-schema", str(grammar)])
    assert both.exit_code != 0 and "not both" in both.output


def test_persistent_session_continues_within_its_grammar_after_kill_9(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon(*SPAWN_ARGS)
    with kvkeep.Client(proc.address, timeout=60) as client:
        s = client.create_session(sampling=HOT, persistent=True)
        part = s.complete(ARITHMETIC_PROMPT, grammar=ARITHMETIC, max_tokens=5)
        assert part.finish_reason == "length"
        expected = s.fork().complete("", max_tokens=LIMIT)  # an ephemeral copy: nothing on disk
        assert expected.finish_reason == "eos"
    assert proc.kill() == -9
    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        resumed = client.session(s.session_id)
        rest = resumed.complete("", max_tokens=LIMIT)
        assert rest.token_ids == expected.token_ids
        assert ArithmeticParser.matches(part.text + rest.text)


BAD = [
    ({"grammar": "root ::= missing"}, "not found"),
    ({"grammar": 'root ::= "a'}, "grammar is invalid"),
    ({"grammar": 'answer ::= "a"'}, "root"),
    ({"grammar": 'root ::= start "!"\nstart ::= "go"'}, "may not be named 'start'"),
    ({"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}, "grammar is invalid"),
    ({"grammar": "root ::= " + " ".join(["[a-z]{0,50}"] * 200)}, "grammar is invalid"),
    ({"grammar": '"a"' * MAX_GRAMMAR_CHARS}, "limit"),
    ({"json_schema": "{not json"}, "JSON schema is invalid"),
    ({"json_schema": "[1, 2]"}, "JSON object"),
    ({"json_schema": {"type": "string", "format": "no-such-format"}}, "JSON schema is invalid"),
    ({"json_schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "JSON schema is invalid"),
    ({"json_schema": "[" * 10000 + "]" * 10000}, "JSON schema is invalid"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "not both"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_grammars_are_invalid_arguments(
    client: kvkeep.Client, kwargs: dict[str, Any], message: str
) -> None:
    s = client.create_session(sampling=kvkeep.SamplingParams(temperature=0.0))
    try:
        with pytest.raises(kvkeep.InvalidRequestError, match=message):
            s.complete("Hello", max_tokens=4, **kwargs)
        with pytest.raises(kvkeep.InvalidRequestError, match=message):
            s.chat("Hello", max_tokens=4, **kwargs)
        assert s.info().n_tokens == 0  # refused before anything changed
        assert s.complete("Hello", max_tokens=2).token_ids  # and the daemon still serves
    finally:
        s.close()


def _snapshot(constraint: Constraint | None) -> Snapshot:
    return Snapshot(
        session_id="s",
        persistent=False,
        created_at=0.0,
        tokens=[1, 2, 3, 4],
        n_kv=4,
        logits=None,
        draws=2,
        params=SamplingParams(seed=1),
        stop=(),
        messages=[],
        fingerprint="f",
        kv_layout=None,
        block_tokens=64,
        constraint=constraint,
    )


def test_manifests_carry_the_open_constraint() -> None:
    key = b"k" * 32
    open_one = Constraint(GrammarSpec("json_schema", json.dumps(PERSON)), 2)
    assert decode(encode(_snapshot(open_one), key), key, 100).constraint == open_one
    assert decode(encode(_snapshot(None), key), key, 100).constraint is None
    for bad in (
        Constraint(GrammarSpec("json_schema", "{}"), 5),  # begins beyond the history
        Constraint(GrammarSpec("lark", "x"), 0),  # type: ignore[arg-type]
        Constraint(GrammarSpec("gbnf", ""), 0),
        Constraint(GrammarSpec("gbnf", "x" * (MAX_GRAMMAR_CHARS + 1)), 0),
    ):
        with pytest.raises(CorruptCheckpoint, match="constraint"):
            decode(encode(_snapshot(bad), key), key, 100)
    good = encode(_snapshot(open_one), key)
    for value in (
        5,
        [],
        {"kind": "gbnf", "text": "x"},
        {"kind": "gbnf", "text": "x", "start": True},
        {"kind": "gbnf", "text": "x", "start": -1},
        {"kind": "gbnf", "text": 7, "start": 0},
        {"kind": None, "text": "x", "start": 0},
    ):

        def edit(meta: dict[str, Any], value: object = value) -> None:
            meta["constraint"] = value

        with pytest.raises(CorruptCheckpoint, match="constraint"):
            decode(remac(edit_manifest(good, edit), key), key, 100)


def test_the_grammars_vocabulary_is_built_at_start(start_daemon: Callable[..., InProcessDaemon]) -> None:
    """The first request with a schema or tools after a start does not wait a few hundred
    milliseconds for llguidance's view of the vocabulary: the daemon builds it as it starts."""
    d = start_daemon()
    assert d.daemon is not None and d.daemon.manager is not None
    grammars = d.daemon.manager._conversations.grammars
    wait_until(lambda: grammars.warmed, 60, "the grammars' vocabulary")
