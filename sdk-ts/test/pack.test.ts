// `npm pack` gives a package that a separate project installs from the tarball and uses from
// both module systems, with type declarations for each.
import { after, before, it } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { PACKAGE_ROOT } from "./helpers.js";

const tmp = mkdtempSync(path.join(os.tmpdir(), "sandlot-pack-"));
const project = path.join(tmp, "consumer");
let files: string[] = [];

function run(cmd: string, args: string[], cwd: string): string {
  return execFileSync(cmd, args, { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

before(() => {
  const packed = JSON.parse(run("npm", ["pack", "--json", "--pack-destination", tmp], PACKAGE_ROOT));
  files = packed[0].files.map((f: { path: string }) => f.path);
  const tarball = path.join(tmp, packed[0].filename);
  execFileSync("mkdir", ["-p", project]);
  writeFileSync(path.join(project, "package.json"), JSON.stringify({ name: "consumer", private: true, version: "1.0.0" }));
  // No registry needed: the package has no dependencies.
  run("npm", ["install", tarball, "--offline", "--no-audit", "--no-fund", "--ignore-scripts"], project);
});
after(() => rmSync(tmp, { recursive: true, force: true }));

it("the tarball holds the builds and declarations, not the sources or tests", () => {
  for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.cjs", "dist/index.d.ts", "dist/index.d.cts"]) {
    assert.ok(files.includes(f), `${f} is missing from ${files.join(", ")}`);
  }
  assert.ok(!files.some((f) => f.startsWith("src/") || f.startsWith("test/") || f.startsWith("build/")));
});

const SCRIPT = (load: string) => `${load}
const checks = {
  sandbox: typeof Sandbox.create === "function",
  errors: new NotFoundError("x") instanceof SandlotError,
  dispose: typeof Sandbox.prototype[Symbol.asyncDispose] === "function",
};
(async () => {
  if (process.env.SANDLOT_URL) checks.health = (await new Sandlot().health()).status;
  console.log(JSON.stringify(checks));
})();
`;

const EXPECTED = { sandbox: true, errors: true, dispose: true, ...(process.env.SANDLOT_URL ? { health: "ok" } : {}) };

it("import (ESM)", () => {
  writeFileSync(path.join(project, "esm.mjs"), SCRIPT('import { Sandbox, Sandlot, NotFoundError, SandlotError } from "sandlot";'));
  assert.deepEqual(JSON.parse(run("node", ["esm.mjs"], project)), EXPECTED);
});

it("require (CommonJS)", () => {
  writeFileSync(path.join(project, "cjs.cjs"), SCRIPT('const { Sandbox, Sandlot, NotFoundError, SandlotError } = require("sandlot");'));
  assert.deepEqual(JSON.parse(run("node", ["cjs.cjs"], project)), EXPECTED);
});

it("the declarations type-check from both module systems", () => {
  const code = `
const client = new Sandlot({ apiUrl: "http://localhost:7070" });
export async function demo(): Promise<number> {
  const sbx: Sandbox = await Sandbox.create({ template: "base", timeoutMs: 60_000 });
  const result: CommandResult = await sbx.commands.run("true", { onStdout: (d: string) => void d });
  const stream: ReadableStream<Uint8Array> = await sbx.files.read("/x", { format: "stream" });
  void stream; void client;
  return result.exitCode;
}
`;
  writeFileSync(path.join(project, "esm.mts"), `import { Sandbox, Sandlot, type CommandResult } from "sandlot";\n${code}`);
  writeFileSync(path.join(project, "cjs.cts"), `import { Sandbox, Sandlot, type CommandResult } from "sandlot";\n${code}`);
  writeFileSync(
    path.join(project, "tsconfig.json"),
    JSON.stringify({
      compilerOptions: {
        module: "node16",
        moduleResolution: "node16",
        target: "ES2022",
        lib: ["ES2022", "ESNext.Disposable"],
        strict: true,
        noEmit: true,
        typeRoots: [path.join(PACKAGE_ROOT, "node_modules", "@types")],
        types: ["node"],
      },
      files: ["esm.mts", "cjs.cts"],
    }),
  );
  run(path.join(PACKAGE_ROOT, "node_modules", ".bin", "tsc"), ["-p", "tsconfig.json"], project);
});
