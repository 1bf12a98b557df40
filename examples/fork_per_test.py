"""Test isolation: keep one seeded base sandbox alive and run every test in a fork of it. Each
test gets the same database; what one test writes, no other test sees.

Seed scenario: "Fork" (test isolation).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys

from sandlot import Sandbox

SEED = """
import sqlite3
db = sqlite3.connect("/app/test.db")
db.execute("CREATE TABLE items (name TEXT PRIMARY KEY, qty INTEGER)")
db.executemany("INSERT INTO items VALUES (?, ?)", [("apple", 3), ("pear", 5)])
db.commit()
"""

# Every test changes the database, then asserts on it; each would break the next if they
# shared one database.
TESTS = {
    "test_insert": "INSERT INTO items VALUES ('plum', 7)|SELECT count(*) FROM items|3",
    "test_delete": "DELETE FROM items WHERE name = 'apple'|SELECT count(*) FROM items|1",
    "test_update": "UPDATE items SET qty = qty * 10|SELECT sum(qty) FROM items|80",
}
RUN_TEST = """
import sqlite3, sys
change, query, expected = sys.argv[1].split("|")
db = sqlite3.connect("/app/test.db")
db.execute(change)
db.commit()
got = str(db.execute(query).fetchone()[0])
sys.exit(0 if got == expected else f"expected {expected}, got {got}")
"""


def main() -> int:
    base = Sandbox.create(timeout=300)
    failures = 0
    try:
        base.files.write("/app/seed.py", SEED)
        base.files.write("/app/run_test.py", RUN_TEST)
        base.commands.run("python3 /app/seed.py", check=True)
        for name, spec in TESTS.items():
            env = base.fork()[0]
            try:
                result = env.commands.run(f"python3 /app/run_test.py \"{spec}\"", timeout=60)
            finally:
                env.kill()
            print(f"{name}: {'ok' if result.ok else 'FAILED ' + result.stderr.strip()}")
            failures += not result.ok
        # The base is untouched by the tests.
        untouched = base.commands.run(
            "python3 -c \"import sqlite3; print(sqlite3.connect('/app/test.db')"
            ".execute('SELECT count(*), sum(qty) FROM items').fetchone())\"").stdout.strip()
        print(f"base database: {untouched}")
        return 1 if failures or untouched != "(2, 8)" else 0
    finally:
        base.kill()


if __name__ == "__main__":
    sys.exit(main())
