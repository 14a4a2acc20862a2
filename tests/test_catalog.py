"""The catalog's block recency: kept in RAM by a restore, written with the next transaction."""

from __future__ import annotations

from pathlib import Path

from kvstashd.catalog import Catalog, CheckpointRow


def _add(catalog: Catalog, checkpoint_id: str, blocks: list[str], now: float) -> None:
    row = CheckpointRow(checkpoint_id, "s_1", "", "explicit", 64, 0, 0, now)
    catalog.add_checkpoint(row, b"manifest", [(k, 100) for k in blocks], now)


def test_touched_blocks_are_dropped_last(tmp_path: Path) -> None:
    path = tmp_path / "catalog.db"
    catalog = Catalog(path)
    _add(catalog, "c_1", ["a" * 64, "b" * 64], now=1.0)
    _add(catalog, "c_2", ["c" * 64], now=2.0)
    catalog.touch(["a" * 64], 3.0)  # as a restore does
    assert catalog.delete("c_1") and catalog.delete("c_2")
    order = [key[0] for key, _ in catalog.unreferenced()]
    assert order == ["b", "c", "a"]
    catalog.close()
    # The recency went to disk with the deletes' transaction: a restart keeps the order.
    again = Catalog(path)
    assert [key[0] for key, _ in again.unreferenced()] == order
    again.forget_blocks(["b" * 64, "c" * 64])
    assert [key for key, _ in again.unreferenced()] == ["a" * 64]
    again.close()


def test_recency_is_written_before_the_order_is_read(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "catalog.db")
    _add(catalog, "c_1", ["a" * 64, "b" * 64], now=1.0)
    assert catalog.delete("c_1")
    catalog.touch(["a" * 64], 5.0)  # no write transaction follows
    assert [key[0] for key, _ in catalog.unreferenced()] == ["b", "a"]
    catalog.close()
