// Builds the console into dist/: one script, one stylesheet, index.html. No network.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, rmSync } from "node:fs";

rmSync("dist", { recursive: true, force: true });
mkdirSync("dist");
await build({
  entryPoints: { app: "src/main.ts" },
  bundle: true,
  minify: true,
  sourcemap: false,
  format: "iife",
  target: "es2020",
  outdir: "dist",
  legalComments: "linked",
  logLevel: "warning",
});
copyFileSync("src/index.html", "dist/index.html");
