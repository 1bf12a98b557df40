/**
 * Test isolation: keep one seeded base sandbox alive and fork a fresh copy of it for every
 * test. Whatever a test writes, the next one starts from the same seeded state.
 *
 * Seed scenario: "Fork" (test isolation).
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import assert from "node:assert/strict";
import { Sandbox } from "sandlot";

// A tiny "app" with a seeded database (a JSON file) and a test runner script.
const RUN_TEST = `
import json, sys
db = json.load(open("/app/db.json"))
name = sys.argv[1]
if name == "test_delete_user":
    db["users"].remove("alice")
elif name == "test_add_user":
    db["users"].append("carol")
elif name == "test_seeded":
    pass
json.dump(db, open("/app/db.json", "w"))
# every test sees the seed: alice and bob, and nothing a previous test did
assert sorted(set(db["users"]) - {"carol"}) in (["alice", "bob"], ["bob"]), db
assert "carol" not in db["users"] or name == "test_add_user", db
assert "alice" in db["users"] or name == "test_delete_user", db
print(name, "ok", db["users"])
`;

const tests = ["test_delete_user", "test_add_user", "test_seeded"];

const base = await Sandbox.create({ timeoutMs: 300_000 });
try {
  await base.files.write("/app/run_test.py", RUN_TEST);
  await base.commands.run(`echo '{"users": ["alice", "bob"]}' > /app/db.json`, { check: true }); // "npm run db:seed"
  for (const test of tests) {
    const [env] = await base.fork();
    try {
      const result = await env.commands.run(`python3 /app/run_test.py ${test}`, { timeoutMs: 60_000 });
      console.log(result.stdout.trim() || result.stderr.trim());
      assert.equal(result.exitCode, 0);
    } finally {
      await env.kill();
    }
  }
  // The base itself was never touched.
  assert.equal(JSON.parse(await base.files.read("/app/db.json")).users.join(","), "alice,bob");
} finally {
  await base.kill();
}
