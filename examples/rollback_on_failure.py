"""Restore to a known-good state on failure: checkpoint before a risky operation; when it
fails, roll the sandbox back in place (same sandbox id), or restore a fresh one from it.

Seed scenarios: "Snapshot & fork" (restore to a known-good state on failure) and
"Checkpoints & Rollback" (roll back to a snapshot).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys

from sandlot import Sandbox

SETUP_DB = """
import sqlite3
db = sqlite3.connect("/srv/app.db")
db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT NOT NULL)")
db.executemany("INSERT INTO users (email) VALUES (?)", [(f"u{i}@example.com",) for i in range(50)])
db.commit()
"""

# A migration that damages the data, then fails half way.
RISKY_MIGRATION = """
import sqlite3, sys
db = sqlite3.connect("/srv/app.db")
db.execute("DELETE FROM users WHERE id % 2 = 0")
db.commit()
sys.exit("migration failed: column 'email' is referenced by a view")
"""

COUNT = "python3 -c \"import sqlite3; print(sqlite3.connect('/srv/app.db')"\
        ".execute('SELECT count(*) FROM users').fetchone()[0])\""


def main() -> int:
    sbx = Sandbox.create(timeout=300)
    snap = restored = None
    try:
        sbx.files.write("/srv/setup_db.py", SETUP_DB)
        sbx.commands.run("python3 /srv/setup_db.py", check=True)
        sbx.commands.run("echo state-ok > /srv/state.txt", check=True)
        snap = sbx.snapshot()
        snap.wait(timeout=120)

        sbx.files.write("/srv/migrate.py", RISKY_MIGRATION)
        failed = sbx.commands.run("python3 /srv/migrate.py && rm /srv/state.txt")
        print(f"migration exit code {failed.exit_code}: {failed.stderr.strip()}")
        print(f"users after the failed migration: {sbx.commands.run(COUNT).stdout.strip()}")
        if failed.ok:
            print("the risky migration was expected to fail", file=sys.stderr)
            return 1

        # Roll the same sandbox back (its id stays), or restore a new one from the checkpoint.
        sbx.rollback(snap)
        restored = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=120)
        for box in (sbx, restored):
            users = box.commands.run(COUNT).stdout.strip()
            state = box.files.read("/srv/state.txt").strip()
            print(f"{box.sandbox_id}: users={users} state={state}")
            if (users, state) != ("50", "state-ok"):
                return 1
        return 0
    finally:
        if restored is not None:
            restored.kill()
        sbx.kill()
        if snap is not None:
            snap.remove()


if __name__ == "__main__":
    sys.exit(main())
