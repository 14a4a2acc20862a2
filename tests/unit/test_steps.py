"""The engine's step plan (engine/steps.py) without a model: which tokens of which generations
go into a step, and how many prompt tokens a shared step takes by the time steps took."""

from __future__ import annotations

import pytest

from kvkeepd.engine.steps import MIN_CHUNK, Pace, plan


def test_a_lone_prompt_takes_whole_batches() -> None:
    assert plan([5000], 512, 64) == [512]
    assert plan([0, 5000, 0], 512, 64) == [0, 512, 0]


def test_beside_a_stream_a_prompt_takes_the_chunk() -> None:
    assert plan([1, 5000], 512, 64) == [1, 64]


def test_a_prompt_that_ends_in_the_step_goes_without_a_longer_ones_chunk() -> None:
    assert plan([1, 5000, 40], 512, 64) == [1, 0, 40]
    assert plan([1, 5000, 30, 20], 512, 64) == [1, 0, 30, 20]


def test_the_shortest_prompt_takes_the_chunk_when_none_ends() -> None:
    assert plan([1, 5000, 300], 512, 64) == [1, 0, 64]


def test_without_a_timed_step_or_a_target_the_pace_is_the_most() -> None:
    assert Pace(0.25, 256).chunk() == 256
    off = Pace(0.0, 256)
    off.took(100, 10.0)
    assert off.chunk() == 256


@pytest.mark.parametrize(
    ("per_token", "chunk"),
    [(0.001, 250), (0.0001, 256), (0.005, 50), (0.1, MIN_CHUNK)],
)
def test_the_pace_keeps_a_step_near_its_target(per_token: float, chunk: int) -> None:
    pace = Pace(0.25, 256)
    for _ in range(30):
        pace.took(100, 100 * per_token)
    assert pace.chunk() == chunk


def test_the_pace_follows_tokens_that_grow_slower() -> None:
    """As a prompt's context grows its tokens cost more: the chunks shrink step by step."""
    pace = Pace(0.25, 256)
    chunks = []
    for step in range(40):
        per_token = 0.001 * (1 + step / 4)
        n = pace.chunk()
        chunks.append(n)
        pace.took(n, n * per_token)
    assert chunks == sorted(chunks, reverse=True)
    assert chunks[-1] < 30 < chunks[1]


def test_steps_of_no_tokens_or_no_time_are_not_counted() -> None:
    pace = Pace(0.25, 256)
    pace.took(0, 1.0)
    pace.took(10, 0.0)
    assert pace.chunk() == 256
