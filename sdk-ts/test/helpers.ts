// Shared by the tests: the server under test (env SANDLOT_URL / SANDLOT_API_KEY, set by
// tests/ts/test_ts_sdk.py), and cleanup of what a test makes.
import { Sandbox, Snapshot } from "sandlot";
import { fileURLToPath } from "node:url";
import path from "node:path";

/** Why VM tests cannot run here, or undefined when a server is configured. */
export const noServer: string | undefined = process.env.SANDLOT_URL
  ? undefined
  : "SANDLOT_URL is not set: run through `pytest tests/ts` (it starts a server), or point it at one";

/** The package's root directory (tests run from build/test/). */
export const PACKAGE_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");

/** Things to kill or delete when a test file ends. */
export class Cleanup {
  private sandboxes: Sandbox[] = [];
  private snapshots: Snapshot[] = [];

  sandbox<T extends Sandbox>(sbx: T): T {
    this.sandboxes.push(sbx);
    return sbx;
  }

  snapshot<T extends Snapshot>(snap: T): T {
    this.snapshots.push(snap);
    return snap;
  }

  async run(): Promise<void> {
    await Promise.allSettled(this.sandboxes.map((s) => s.kill()));
    await Promise.allSettled(this.snapshots.map((s) => s.remove()));
    this.sandboxes = [];
    this.snapshots = [];
  }
}
