"""`kvkeep info` and `kvkeep serve`: what the daemon says of itself, and running one."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import click

from kvkeep._types import Info
from kvkeep.cli._context import State, fail
from kvkeep.cli._output import echo_fields, echo_json, format_size


@click.command()
@click.pass_obj
def info(state: State) -> None:
    """Show the daemon's model, engine, doors, sessions and counters (--json: every field)."""
    result = state.client().info()
    if state.as_json:
        echo_json(result)
    else:
        echo_fields(_readable(result, state.address))


def _readable(i: Info, address: str) -> list[tuple[str, object]]:
    """GetInfo as a person reads it: a few lines, each about one thing."""
    model = Path(i.model_path).name if i.model_path else ""
    template = "none (run completes text; chat refuses)"
    if i.has_chat_template:
        template = f"yes, tool calls as {i.tool_format}" if i.tool_format else "yes"
    device = i.backend or "CPU"
    if i.device and i.device_memory_total:
        device += (
            f" ({i.device}, {format_size(i.device_memory_free)} free of {format_size(i.device_memory_total)})"
        )
    mode = i.mode + (f": {i.mode_note}" if i.mode_note else "")
    attention = "flash attention" if i.flash_attention else "attention without flash"
    if i.mode == "exact" and i.flash_attention:
        attention += " (batch-invariant)"
    attention += f" ({i.attention_note})" if i.attention_note else ""
    return [
        ("daemon", f"kvkeep {i.version} at {address}"),
        (
            "model",
            f"{i.model_description}{f' ({model})' if model else ''}, fingerprint {i.model_fingerprint[:12]}",
        ),
        (
            "memory",
            f"{i.architecture}, {i.memory_type}; checkpoints carry state: {_yes(i.checkpoints_carry_state)}",
        ),
        ("chat template", template),
        ("mode", mode),
        ("engine", f"{i.slots} slots x {i.ctx_per_session} tokens, KV {i.kv_type}, {attention}, on {device}"),
        ("HTTP (OpenAI)", f"http://{i.http_address}/v1" if i.http_address else "off"),
        ("metrics", f"http://{i.metrics_address}/metrics" if i.metrics_address else "off"),
        (
            "sessions",
            f"{i.sessions} ({i.sessions_hot} in slots, {i.sessions_warm} parked, {i.sessions_cold} stored); "
            f"{i.slots_in_use} of {i.slots} slots in use",
        ),
        (
            "tokens",
            f"{i.tokens_evaluated} evaluated, {i.tokens_reused} reused, {i.tokens_generated} generated; "
            f"{i.swap_ins} swap-ins in {i.swap_in_seconds_total:.2f} s",
        ),
        (
            "limits",
            f"prompts up to {i.max_prompt_tokens} tokens; checkpoint blocks of {i.block_tokens} tokens",
        ),
    ]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def serve(ctx: click.Context) -> None:
    """Run the daemon (from kvkeep[daemon]); `kvkeep serve --help` lists its options."""
    # Imported here: the client must work where the daemon and llama.cpp are not installed.
    # The server module imports every dependency of the daemon, so a missing one shows here;
    # the options alone (kvkeepd.cli) need none of them, so --help works everywhere.
    daemon_cli = importlib.import_module("kvkeepd.cli")
    try:
        importlib.import_module("kvkeepd.server")
    except ImportError as e:
        missing = f"no module {e.name!r}" if e.name else str(e)
        needs = f"kvkeep serve needs the daemon's dependencies ({missing}): pip install 'kvkeep[daemon]'"
        if "--help" not in ctx.args:
            fail(needs)
        click.echo(f"note: {needs}", err=True)
    daemon_cli.main(ctx.args, prog_name="kvkeep serve")


@click.command()
@click.argument("model", metavar="hf:OWNER/REPO[:QUANT]")
@click.option(
    "--model-cache",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="KVKEEP_MODEL_CACHE",
    help="Where models are kept, as `kvkeep serve --model-cache`.  [default: $XDG_CACHE_HOME/kvkeep/models]",
)
def pull(model: str, model_cache: Path | None) -> None:
    """Download a GGUF model from the Hugging Face Hub (or HF_ENDPOINT's mirror) into the model
    cache, and print its path; `kvkeep serve --model hf:...` then starts at once.

    QUANT picks a file by its quantization (Q4_K_M, the default where there is one) or names
    it (a .gguf file name). A download cut short goes on from where it stopped; one that
    stalls (30 s without a byte, resumed while each try brings more, at most 5 times) or
    crawls (under 32 KiB/s over 30 s) gives up; a file whose SHA-256 is not the Hub's is
    removed. A file name that would land outside the repository's folder is refused.
    """
    try:
        models = importlib.import_module("kvkeepd.model.choice")
        settings = importlib.import_module("kvkeepd.config.settings")
        hub = importlib.import_module("kvkeepd.model.hub")
        importlib.import_module("huggingface_hub")
    except ImportError as e:
        missing = f"no module {e.name!r}"
        fail(f"kvkeep pull needs the daemon's dependencies ({missing}): pip install 'kvkeep[daemon]'")
    try:
        ref = models.hf_ref(model)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="MODEL") from None
    if ref is None:
        raise click.BadParameter(
            f"a model on the Hub is hf:OWNER/REPO[:QUANT], got {model!r}", param_hint="MODEL"
        )
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("kvkeepd.model.hub").setLevel(logging.INFO)
    try:
        path = hub.fetch(ref, model_cache or settings.user_cache_dir() / "models")
    except hub.HubError as e:
        fail(str(e))
    click.echo(str(path))
