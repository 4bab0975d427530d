"""The on-disk outbox: every message is written (and fsynced) before the first delivery attempt.

Why sqlite3 and not a JSONL file: delivery needs to mark single messages done, reschedule them and find
the next due one; a log would need compaction to do that. sqlite with ``synchronous=FULL`` fsyncs each
commit, so a message acknowledged by :meth:`Outbox.put` survives a crash or a restart, and a receiver
outage only makes the table longer (bounded by ``max_pending`` per sink, oldest dropped first and counted).

The same file keeps the set of firing alerts, so after a restart the agent still sends the resolution of
an alert it raised before.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.webhooks.alerts import Alert

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id TEXT PRIMARY KEY,
    sink TEXT NOT NULL,
    created_at REAL NOT NULL,
    next_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT NOT NULL DEFAULT '',
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (sink, next_at);
CREATE TABLE IF NOT EXISTS active_alerts (fingerprint TEXT PRIMARY KEY, alert TEXT NOT NULL);
"""


class OutboxError(RuntimeError):
    """The outbox file cannot be opened or written; the message names the path."""


@dataclass(frozen=True)
class Message:
    """One queued delivery. ``id`` doubles as the receiver's idempotency key (``webhook-id``)."""

    id: str
    sink: str
    created_at: float
    next_at: float
    attempts: int
    body: bytes
    last_error: str = ""


class Outbox:
    """A durable queue of messages per sink. Not thread-safe: use it from the agent's event loop."""

    def __init__(self, path: str | Path, *, max_pending: int = 10_000) -> None:
        self.path = str(path)
        self.max_pending = max_pending
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as error:
            raise OutboxError(f"cannot open webhook outbox {self.path!r}: {error}") from None

    def put(self, message: Message) -> tuple[bool, int]:
        """Store ``message``; return (stored, how many oldest messages were evicted to make room).

        A message whose id is already queued is ignored (stored = False): the second half of dedup.
        """
        with self._db:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO outbox (id, sink, created_at, next_at, attempts, last_error, body) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    message.id,
                    message.sink,
                    message.created_at,
                    message.next_at,
                    message.attempts,
                    message.last_error,
                    message.body,
                ),
            )
            stored = cur.rowcount == 1
            evicted = 0
            excess = self.pending(message.sink) - self.max_pending
            if excess > 0:
                evicted = self._db.execute(
                    "DELETE FROM outbox WHERE id IN "
                    "(SELECT id FROM outbox WHERE sink = ? ORDER BY rowid LIMIT ?)",
                    (message.sink, excess),
                ).rowcount
        return stored, evicted

    def due(self, now: float, limit: int = 100) -> list[Message]:
        """What to attempt now: per sink, the front of its queue up to the first message still waiting for
        its retry, in the order they were stored (sqlite's ``rowid``).

        A message never overtakes an older one of its sink. Seen live: a receiver came back while the
        firing message waited out its backoff, and the resolution, queued later but due at once, reached
        it first; a receiver that keeps each alert's last status then showed the alert firing for good.
        """
        due: list[tuple[int, Message]] = []
        for (sink,) in self._db.execute("SELECT DISTINCT sink FROM outbox").fetchall():
            rows = self._db.execute(
                "SELECT rowid, id, sink, created_at, next_at, attempts, body, last_error FROM outbox "
                "WHERE sink = ? ORDER BY rowid LIMIT ?",
                (sink, limit),
            ).fetchall()
            for r in rows:
                if r[4] > now:
                    break
                due.append((r[0], Message(r[1], r[2], r[3], r[4], r[5], bytes(r[6]), r[7])))
        return [msg for _, msg in sorted(due, key=lambda pair: pair[0])]

    def next_due_at(self) -> float | None:
        """When the earliest queue front is due: a message behind its sink's front waits for it."""
        row = self._db.execute(
            "SELECT MIN(o.next_at) FROM outbox AS o "
            "WHERE o.rowid = (SELECT MIN(rowid) FROM outbox WHERE sink = o.sink)"
        ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def remove(self, msg_id: str) -> None:
        """Forget a message: delivered, rejected for good, or expired."""
        with self._db:
            self._db.execute("DELETE FROM outbox WHERE id = ?", (msg_id,))

    def discard(self, sink: str) -> int:
        """Remove every message queued for ``sink`` (a receiver taken out of the config); returns how many."""
        with self._db:
            return int(self._db.execute("DELETE FROM outbox WHERE sink = ?", (sink,)).rowcount)

    def retry_at(self, msg_id: str, next_at: float, error: str) -> None:
        with self._db:
            self._db.execute(
                "UPDATE outbox SET next_at = ?, attempts = attempts + 1, last_error = ? WHERE id = ?",
                (next_at, error[:500], msg_id),
            )

    def pending(self, sink: str) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM outbox WHERE sink = ?", (sink,)).fetchone()[0])

    def oldest_created_at(self, sink: str) -> float | None:
        row = self._db.execute("SELECT MIN(created_at) FROM outbox WHERE sink = ?", (sink,)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def save_active(self, alerts: Iterable[Alert]) -> None:
        """Replace the stored set of firing alerts (one transaction)."""
        with self._db:
            self._db.execute("DELETE FROM active_alerts")
            self._db.executemany(
                "INSERT INTO active_alerts (fingerprint, alert) VALUES (?, ?)",
                [(a.fingerprint, json.dumps(a.to_json(), sort_keys=True)) for a in alerts],
            )

    def load_active(self) -> list[Alert]:
        rows = self._db.execute("SELECT alert FROM active_alerts ORDER BY fingerprint").fetchall()
        return [Alert.from_json(json.loads(r[0])) for r in rows]

    def close(self) -> None:
        self._db.close()
