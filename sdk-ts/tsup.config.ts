import { defineConfig } from "tsup";

// One bundle per module system, each with its own declarations (.d.ts for ESM, .d.cts for CJS).
export default defineConfig({
  entry: ["src/index.ts"],
  format: ["esm", "cjs"],
  dts: true,
  target: "node18",
  platform: "node",
  sourcemap: true,
  clean: true,
  splitting: false,
});
