// The REST types cannot drift from the contract: regenerating them from openapi.yaml must give
// exactly the committed src/generated/openapi.ts (`npm run generate` rewrites it).
import { it } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { PACKAGE_ROOT } from "./helpers.js";

it("src/generated/openapi.ts is what openapi-typescript makes of ../openapi.yaml", () => {
  const tmp = mkdtempSync(path.join(os.tmpdir(), "sandlot-openapi-"));
  try {
    const out = path.join(tmp, "openapi.ts");
    execFileSync(
      path.join(PACKAGE_ROOT, "node_modules", ".bin", "openapi-typescript"),
      [path.join(PACKAGE_ROOT, "..", "openapi.yaml"), "--output", out],
      { cwd: PACKAGE_ROOT, stdio: "pipe" },
    );
    const committed = readFileSync(path.join(PACKAGE_ROOT, "src", "generated", "openapi.ts"), "utf8");
    assert.ok(
      readFileSync(out, "utf8") === committed,
      "src/generated/openapi.ts is stale: run `npm run generate` in sdk-ts/ and rebuild",
    );
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});
