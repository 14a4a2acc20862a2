"""The embedded catalog's tables (sqlite.py): sessions and their heads, checkpoints with
their manifests, each checkpoint's block references, the blocks' sizes and last use, and
stored responses' records."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    head TEXT,
    tenant TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS checkpoints (
    checkpoint_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    label TEXT NOT NULL,
    kind TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    bytes_written INTEGER NOT NULL,
    bytes_referenced INTEGER NOT NULL,
    created_at REAL NOT NULL,
    manifest BLOB NOT NULL,
    tenant TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS checkpoints_session ON checkpoints (session_id);
CREATE TABLE IF NOT EXISTS refs (
    checkpoint_id TEXT NOT NULL,
    block TEXT NOT NULL,
    PRIMARY KEY (checkpoint_id, block)
);
CREATE INDEX IF NOT EXISTS refs_block ON refs (block);
CREATE TABLE IF NOT EXISTS blocks (
    block TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS responses (
    checkpoint_id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""

# A checkpoint row's columns, in CheckpointRow's order.
COLUMNS = (
    "checkpoint_id, session_id, label, kind, n_tokens, bytes_written, bytes_referenced, created_at, tenant"
)
