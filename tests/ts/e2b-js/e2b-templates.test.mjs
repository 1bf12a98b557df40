// The unmodified e2b npm package's Template builder against sandlot: a template from an image
// with a COPY of a local file and a RUN, a sandbox of it, exists, and a failing step.
// tests/ts/test_ts_sdk.py sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_TEST_IMAGE
// (the Debian test image in the session's loopback registry).
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, writeFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const [major, minor] = process.versions.node.split(".").map(Number);
const e2b = await import(major > 20 || (major === 20 && minor >= 19) ? "e2b" : "e2b/dist/index.mjs");
const { Sandbox, Template } = e2b;

const image = process.env.E2B_TEST_IMAGE;
const skip = image && process.env.E2B_API_URL ? false : "E2B_TEST_IMAGE and E2B_API_URL must be set";

describe("the e2b npm package's template builds on sandlot", { skip }, () => {
  const ctx = mkdtempSync(join(tmpdir(), "e2b-js-tpl-"));
  after(() => rmSync(ctx, { recursive: true, force: true }));

  it("builds from an image with a copy and a run; a sandbox of it has both", async () => {
    writeFileSync(join(ctx, "note.txt"), "from the js context\n");
    const template = Template({ fileContextPath: ctx })
      .fromImage(image)
      .copy("note.txt", "/home/user/note.txt")
      .runCmd("echo js-run > /home/user/ran.txt");
    const logs = [];
    const info = await Template.build(template, "e2b-js-template", {
      cpuCount: 1, memoryMB: 512, onBuildLogs: (e) => logs.push(String(e.message)),
    });
    assert.equal(info.templateId, "e2b-js-template");
    assert.ok(logs.some((l) => l.includes("[2/2] RUN")), logs.join("\n"));
    assert.equal(await Template.exists("e2b-js-template"), true);
    assert.equal(await Template.exists("e2b-js-nothing"), false);
    const sbx = await Sandbox.create("e2b-js-template", { timeoutMs: 300_000 });
    try {
      assert.equal(await sbx.files.read("/home/user/note.txt"), "from the js context\n");
      assert.equal((await sbx.commands.run("cat /home/user/ran.txt; whoami")).stdout, "js-run\nuser\n");
    } finally {
      await sbx.kill();
    }
  });

  it("a failing step raises the build error with its output", async () => {
    const template = Template().fromImage(image).runCmd("echo js-boom >&2; exit 4");
    await assert.rejects(Template.build(template, "e2b-js-failing"), (err) => {
      assert.match(String(err.message), /js-boom/);
      return true;
    });
  });
});
