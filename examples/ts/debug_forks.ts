/**
 * Debugging: keep a sandbox at the point of interest (a process stuck in a bad state) and fork
 * it repeatedly; each investigation pokes at its own copy, so the next one sees the same state.
 *
 * Seed scenario: "Fork" (debugging).
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandbox } from "sandlot";

// The "program": reaches a buggy state (a counter that went negative) and then waits.
const PROGRAM = `
import os, time
state = {"counter": 3}
for _ in range(5):
    state["counter"] -= 1
open("/tmp/program.state", "w").write(repr(state))
open("/tmp/program.pid", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
`;

const sandbox = await Sandbox.create({ timeoutMs: 300_000 });
try {
  await sandbox.files.write("/app/program.py", PROGRAM);
  await sandbox.commands.start("python3 /app/program.py");
  await sandbox.commands.run("while [ ! -s /tmp/program.pid ]; do sleep 0.1; done", { timeoutMs: 60_000, check: true });
  // The sandbox is at the buggy state: investigate it five times, each on a fork.
  const probes = [
    "cat /tmp/program.state",
    "cat /proc/$(cat /tmp/program.pid)/status | head -3",
    "ls -l /proc/$(cat /tmp/program.pid)/fd | tail -n +2 | wc -l",
    "kill -9 $(cat /tmp/program.pid); sleep 0.2; ps -e | grep -c python3 || true", // destructive, on a copy
    "cat /proc/$(cat /tmp/program.pid)/cmdline | tr '\\0' ' '",
  ];
  for (const [i, probe] of probes.entries()) {
    const [investigation] = await sandbox.fork();
    try {
      const logs = await investigation.commands.run(`${probe} 2>&1 | head -100`, { timeoutMs: 30_000 });
      console.log(`investigation ${i}: ${logs.stdout.trim().replace(/\n/g, " / ")}`);
      if (i === 0 && !logs.stdout.includes("'counter': -2")) throw new Error("the fork lost the program's state");
    } finally {
      await investigation.kill();
    }
  }
  // The destructive probe ran on a copy: the program still runs in the original.
  const alive = await sandbox.commands.run("kill -0 $(cat /tmp/program.pid) && echo alive");
  console.log(`original: ${alive.stdout.trim()}`);
  if (alive.stdout.trim() !== "alive") throw new Error("the original program died");
} finally {
  await sandbox.kill();
}
