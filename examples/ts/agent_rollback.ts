/**
 * AI agent rollback: try each piece of generated code on a fork first. If it works, replay it
 * on the original; if it fails, throw the fork away: the original never sees the damage.
 *
 * Seed scenario: "Fork" (AI agent rollback; also "fork a risky operation, discard when done").
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandbox } from "sandlot";

// Two "AI-generated" steps: one breaks the project and fails, one works.
const GENERATED = [
  "rm -rf /project/src && sed -i 's/1/one/' /project/VERSION && false",
  "mkdir -p /project/docs && echo '# Usage' > /project/docs/README.md && test -d /project/src",
];

const sandbox = await Sandbox.create({ timeoutMs: 300_000 });
try {
  await sandbox.commands.run("mkdir -p /project/src && echo 'print(1)' > /project/src/main.py && echo 1 > /project/VERSION", {
    check: true,
  });
  for (const [step, aiGeneratedCode] of GENERATED.entries()) {
    const [branch] = await sandbox.fork();
    let result;
    try {
      result = await branch.commands.run(aiGeneratedCode, { timeoutMs: 60_000 });
    } finally {
      await branch.kill(); // discard the branch either way
    }
    if (result.ok) {
      await sandbox.commands.run(aiGeneratedCode, { timeoutMs: 60_000, check: true }); // replay on the original
      console.log(`step ${step}: worked on a fork, replayed on the original`);
    } else {
      console.log(`step ${step}: failed on a fork (exit ${result.exitCode}), discarded`);
    }
  }
  const state = (await sandbox.commands.run("cat /project/VERSION; ls /project/src; ls /project/docs")).stdout.split(/\s+/).filter(Boolean);
  console.log(`original: ${JSON.stringify(state)}`);
  if (state.join(",") !== "1,main.py,README.md") throw new Error("the original was damaged");
} finally {
  await sandbox.kill();
}
