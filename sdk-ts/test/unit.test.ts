// No server: error mapping, configuration, client-side validation and stream parsing, through
// a stub `fetch` (the SDK takes one in its options, as a transport).
import { describe, it } from "node:test";
import assert from "node:assert/strict";
import net from "node:net";
import {
  AuthenticationError,
  PermissionDeniedError,
  BuildError,
  BuildStepError,
  ImageError,
  ImageNotFoundError,
  CapacityError,
  CommandExitError,
  CommandTimeoutError,
  ConflictError,
  ERRORS,
  GuestError,
  InvalidArgumentError,
  InvalidStateError,
  NotFoundError,
  Sandbox,
  SandboxError,
  Sandlot,
  SandlotError,
  Snapshot,
  SnapshotFailedError,
  PayloadTooLargeError,
  StorageError,
  VmmError,
  WaitTimeoutError,
  errorFromPayload,
  errorFromResponse,
  type ConnectionOptions,
} from "sandlot";

/** A loopback port nothing listens on. */
async function closedPort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

type Handler = (url: URL, init: RequestInit) => Response | Promise<Response>;

/** Connection options whose fetch answers with `handler` and records each call. */
function stub(handler: Handler): ConnectionOptions & { calls: { url: URL; init: RequestInit }[] } {
  const calls: { url: URL; init: RequestInit }[] = [];
  const fetchStub = (async (input: string | URL | Request, init: RequestInit = {}) => {
    const url = new URL(String(input));
    calls.push({ url, init });
    return handler(url, init);
  }) as typeof fetch;
  return { apiUrl: "http://sandlot.test/", apiKey: "sl_k", fetch: fetchStub, calls };
}

function json(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
}

const SANDBOX = { sandbox_id: "sb-1", state: "running", memory_mb: 512, cpus: 1 };

const TREE: [string, new (...args: never[]) => SandlotError, number, (new (...args: never[]) => SandlotError)[]][] = [
  ["InvalidArgumentError", InvalidArgumentError, 400, [SandlotError]],
  ["AuthenticationError", AuthenticationError, 401, [SandlotError]],
  ["PermissionDeniedError", PermissionDeniedError, 403, [AuthenticationError, SandlotError]],
  ["NotFoundError", NotFoundError, 404, [SandlotError]],
  ["ConflictError", ConflictError, 409, [SandlotError]],
  ["InvalidStateError", InvalidStateError, 409, [SandlotError]],
  ["CommandTimeoutError", CommandTimeoutError, 504, [SandlotError]],
  ["SandboxError", SandboxError, 502, [SandlotError]],
  ["GuestError", GuestError, 502, [SandboxError, SandlotError]],
  ["VmmError", VmmError, 502, [SandboxError, SandlotError]],
  ["PayloadTooLargeError", PayloadTooLargeError, 413, [InvalidArgumentError, SandlotError]],
  ["CapacityError", CapacityError, 503, [SandlotError]],
  ["StorageError", StorageError, 500, [SandlotError]],
  ["BuildError", BuildError, 500, [SandlotError]],
  ["ImageError", ImageError, 400, [InvalidArgumentError, SandlotError]],
  ["BuildStepError", BuildStepError, 400, [ImageError, InvalidArgumentError, SandlotError]],
  ["ImageNotFoundError", ImageNotFoundError, 404, [NotFoundError, SandlotError]],
  ["SnapshotFailedError", SnapshotFailedError, 502, [SandboxError, SandlotError]],
  ["WaitTimeoutError", WaitTimeoutError, 504, [SandlotError]],
];

describe("error tree", () => {
  for (const [type, cls, status, parents] of TREE) {
    it(`a ${status} {"type": "${type}"} answer is a ${type}`, async () => {
      const conn = stub(() => json(status, { error: { type, message: `boom ${type}` } }));
      const error = await Sandbox.connect("sb-x", conn).then(
        () => assert.fail("no error"),
        (e: unknown) => e,
      );
      assert.ok(error instanceof cls, `${String(error)} is not a ${type}`);
      for (const parent of parents) assert.ok(error instanceof parent);
      assert.equal((error as SandlotError).name, type);
      assert.equal((error as SandlotError).message, `boom ${type}`);
      assert.equal((error as SandlotError).status, status);
      assert.equal(ERRORS[type], cls);
    });
  }

  it("falls back to the class of the status for an unknown type or a body that is not JSON", () => {
    assert.ok(errorFromPayload({ type: "Whatever", message: "m" }, 404) instanceof NotFoundError);
    assert.ok(errorFromPayload({ type: "toString", message: "m" }, 409) instanceof ConflictError);
    assert.equal(errorFromPayload({ message: "m" }).constructor, SandlotError);
    const e = errorFromResponse(502, "<html>bad gateway</html>");
    assert.ok(e instanceof SandboxError);
    assert.match(e.message, /^HTTP 502: <html>bad gateway/);
  });

  it("says how to give a key when a 401 came without one", () => {
    const e = errorFromResponse(401, JSON.stringify({ error: { type: "AuthenticationError", message: "bad key" } }), false);
    assert.ok(e instanceof AuthenticationError);
    assert.match(e.message, /SANDLOT_API_KEY/);
  });

  it("CommandExitError carries the result", () => {
    const e = new CommandExitError({ stdout: "o", stderr: "a\nlast line\n", exitCode: 2, ok: false }, "make");
    assert.ok(e instanceof SandlotError);
    assert.equal(e.exitCode, 2);
    assert.equal(e.stdout, "o");
    assert.match(e.message, /"make" exited with code 2: last line/);
  });
});

describe("configuration", () => {
  it("options win over env; the URL loses trailing slashes; the key goes in Authorization", async () => {
    const conn = stub(() => json(200, { status: "ok" }));
    const client = new Sandlot(conn);
    assert.equal(client.apiUrl, "http://sandlot.test");
    await client.health();
    const headers = conn.calls[0].init.headers as Record<string, string>;
    assert.equal(headers.Authorization, "Bearer sl_k");
    assert.equal(conn.calls[0].url.pathname, "/health");
  });

  it("reads SANDLOT_URL and SANDLOT_API_KEY", async () => {
    const saved = { url: process.env.SANDLOT_URL, key: process.env.SANDLOT_API_KEY };
    process.env.SANDLOT_URL = "http://from-env.test:1234";
    process.env.SANDLOT_API_KEY = "sl_env";
    try {
      let seen: { url: URL; init: RequestInit } | undefined;
      const client = new Sandlot({
        fetch: (async (input: string, init: RequestInit) => {
          seen = { url: new URL(input), init };
          return json(200, { status: "ok" });
        }) as typeof fetch,
      });
      await client.health();
      assert.equal(seen?.url.host, "from-env.test:1234");
      assert.equal((seen?.init.headers as Record<string, string>).Authorization, "Bearer sl_env");
    } finally {
      process.env.SANDLOT_URL = saved.url ?? "";
      process.env.SANDLOT_API_KEY = saved.key ?? "";
      if (saved.url === undefined) delete process.env.SANDLOT_URL;
      if (saved.key === undefined) delete process.env.SANDLOT_API_KEY;
    }
  });

  it("a server that is not there is a SandlotError with the cause kept", async () => {
    const port = await closedPort();
    const error = await Sandbox.connect("sb-1", { apiUrl: `http://127.0.0.1:${port}`, apiKey: "k" }).catch((e) => e);
    assert.equal(error.constructor, SandlotError);
    assert.match(error.message, new RegExp(`cannot connect to the sandlot server at http://127.0.0.1:${port}`));
    assert.ok(error.cause);
  });

  it("a request past requestTimeoutMs is a SandlotError", async () => {
    const conn = stub(
      (_url, init) =>
        new Promise<Response>((_resolve, reject) => {
          init.signal?.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError")));
        }),
    );
    const keepAlive = setInterval(() => undefined, 1000); // the stub holds no socket open
    const error = await Sandbox.connect("sb-1", { ...conn, requestTimeoutMs: 50 })
      .catch((e) => e)
      .finally(() => clearInterval(keepAlive));
    assert.equal(error.constructor, SandlotError);
    assert.match(error.message, /timed out/);
  });
});

describe("requests", () => {
  it("create sends the REST body of openapi.yaml, in seconds", async () => {
    const conn = stub(() => json(201, { ...SANDBOX, metadata: { a: "b" }, created_at: "2026-01-01T00:00:00Z" }));
    const sbx = await Sandbox.create({
      ...conn,
      memoryMb: 1024,
      env: { A: "1" },
      timeoutMs: 90_500,
      metadata: { a: "b" },
      network: { allowOut: ["10.0.0.0/8"] },
    });
    const body = JSON.parse(String(conn.calls[0].init.body));
    assert.deepEqual(body, {
      template: "base",
      snapshot_id: null,
      image: null,
      memory_mb: 1024,
      cpus: null,
      env: { A: "1" },
      timeout: 91,
      metadata: { a: "b" },
      internet: true,
      network: { allow_out: ["10.0.0.0/8"], deny_out: [] },
      on_timeout: "kill",
      pause_memory: true,
      auto_resume: false,
    });
    assert.equal(sbx.sandboxId, "sb-1");
    assert.equal(sbx.info.memoryMb, 512);
    assert.ok(sbx.info.createdAt instanceof Date);
  });

  it("create from an image sends it instead of a template", async () => {
    const conn = stub(() => json(201, SANDBOX));
    await Sandbox.create({ ...conn, image: "python:3.12-slim" });
    const body = JSON.parse(String(conn.calls[0].init.body));
    assert.equal(body.image, "python:3.12-slim");
    assert.equal(body.template, null);
  });

  it("rejects bad arguments before sending anything", async () => {
    const conn = stub(() => json(200, SANDBOX));
    const sbx = await Sandbox.connect("sb-1", conn);
    await assert.rejects(sbx.files.read("relative/path"), InvalidArgumentError);
    await assert.rejects(sbx.getHost(70000), InvalidArgumentError);
    await assert.rejects(sbx.fork(0), InvalidArgumentError);
    await assert.rejects(sbx.commands.run(""), InvalidArgumentError);
    await assert.rejects(sbx.commands.run("true", { timeoutMs: -1 }), InvalidArgumentError);
    await assert.rejects(Sandbox.connect("", conn), InvalidArgumentError);
    await assert.rejects(sbx.rollback(""), InvalidArgumentError);
    assert.equal(conn.calls.length, 1);
  });

  it("a fork's per-child errors are typed and sorted; all failing throws the first", async () => {
    let answer: unknown = {
      sandboxes: [SANDBOX],
      errors: [
        { index: 2, error: { type: "VmmError", message: "qemu died" } },
        { index: 1, error: { type: "StorageError", message: "disk full" } },
      ],
      pause_ms: 12.5,
    };
    const conn = stub((url) => (url.pathname.endsWith("/fork") ? json(200, answer) : json(200, SANDBOX)));
    const sbx = await Sandbox.connect("sb-1", conn);
    const children = await sbx.fork(3);
    assert.equal(children.length, 1);
    assert.equal(children.pauseMs, 12.5);
    assert.ok(children.errors[0] instanceof StorageError);
    assert.ok(children.errors[1] instanceof VmmError);
    assert.match(children.errors[0].message, /^fork child 1: disk full/);
    assert.ok(Array.isArray(children.map((c) => c.sandboxId)));
    answer = { sandboxes: [], errors: [{ index: 0, error: { type: "VmmError", message: "no" } }], pause_ms: 1 };
    await assert.rejects(sbx.fork(1), VmmError);
  });

  it("a snapshot forks with the settings given; each child's failure is its own", async () => {
    let answer: unknown = {
      sandboxes: [SANDBOX, { ...SANDBOX, sandbox_id: "sb-2" }],
      errors: [{ index: 1, error: { type: "CapacityError", message: "host full" } }],
      pause_ms: 0,
    };
    const conn = stub((url) =>
      url.pathname.endsWith("/fork") ? json(200, answer) : json(200, { snapshot_id: "snap-1", state: "ready" }),
    );
    const snap = await Snapshot.get("snap-1", conn);
    const children = await snap.fork(3, { env: { K: "v" }, timeoutMs: 60_000, metadata: { m: "1" } });
    assert.deepEqual(children.map((c) => c.sandboxId), ["sb-1", "sb-2"]);
    assert.ok(children.errors[0] instanceof CapacityError);
    assert.match(children.errors[0].message, /^fork child 1: host full/);
    const sent = conn.calls.at(-1)!;
    assert.equal(sent.url.pathname, "/v1/snapshots/snap-1/fork");
    const body = JSON.parse(String(sent.init.body));
    assert.deepEqual([body.count, body.env, body.timeout, body.metadata], [3, { K: "v" }, 60, { m: "1" }]);
    assert.equal("name" in body, false);
    answer = { sandboxes: [], errors: [{ index: 0, error: { type: "NotFoundError", message: "gone" } }], pause_ms: 0 };
    await assert.rejects(snap.fork(1), NotFoundError);
    const calls = conn.calls.length;
    await assert.rejects(snap.fork(0), InvalidArgumentError);
    assert.equal(conn.calls.length, calls);
  });
});

describe("snapshot waits", () => {
  const snapshot = (state: string, error: string | null = null) => ({ snapshot_id: "snap-1", state, error });

  it("createSnapshot resolves once the state is captured, or throws if the capture failed", async () => {
    let gets = 0;
    let final = snapshot("uploading");
    const conn = stub((url, init) => {
      if (url.pathname === "/v1/sandboxes/sb-1") return json(200, SANDBOX);
      if (init.method === "POST") return json(201, snapshot("creating"));
      gets++;
      return json(200, gets < 3 ? snapshot("creating") : final);
    });
    const sbx = await Sandbox.connect("sb-1", conn);
    const snap = await sbx.createSnapshot({ name: "n" });
    assert.equal(snap.state, "uploading");
    assert.equal(gets, 3);
    assert.equal(JSON.parse(String(conn.calls[1].init.body)).name, "n");
    gets = 0;
    final = snapshot("failed", "capture failed: qemu died");
    const error = await sbx.snapshot().catch((e) => e);
    assert.ok(error instanceof SnapshotFailedError);
    assert.match(error.message, /qemu died/);
  });

  it("a snapshot that fails while waited on is a SnapshotFailedError", async () => {
    const conn = stub((url) =>
      url.pathname.endsWith("/wait") ? json(200, snapshot("failed", "disk full")) : json(200, snapshot("creating")),
    );
    const snap = await Snapshot.get("snap-1", conn);
    const error = await snap.wait().catch((e) => e);
    assert.ok(error instanceof SnapshotFailedError);
    assert.ok(error instanceof SandboxError);
    assert.equal(error.snapshotId, "snap-1");
    assert.match(error.message, /disk full/);
  });

  it("a wait past its timeout is a WaitTimeoutError; the long poll never outlasts it", async () => {
    const conn = stub(async (url) => {
      if (url.pathname.endsWith("/wait")) {
        await new Promise((r) => setTimeout(r, Number(url.searchParams.get("timeout")) * 1000));
      }
      return json(200, snapshot("uploading"));
    });
    const snap = await Snapshot.get("snap-1", conn);
    const started = Date.now();
    await assert.rejects(snap.wait({ timeoutMs: 300 }), WaitTimeoutError);
    assert.ok(Date.now() - started < 2000);
    const waits = conn.calls.filter((c) => c.url.pathname.endsWith("/wait"));
    assert.ok(waits.length >= 1 && Number(waits[0].url.searchParams.get("timeout")) <= 0.3);
  });
});

describe("command streams", () => {
  const ndjson = (...events: unknown[]) =>
    new Response(events.map((e) => JSON.stringify(e)).join("\n") + "\n", {
      status: 200,
      headers: { "content-type": "application/x-ndjson" },
    });

  it("an error event ends the stream with its typed error", async () => {
    const conn = stub((url) =>
      url.pathname.endsWith("/commands")
        ? ndjson(
            { type: "start", pid: 7 },
            { type: "stdout", data: "partial" },
            { type: "error", error: { type: "CommandTimeoutError", message: "timed out after 1s" } },
          )
        : json(200, SANDBOX),
    );
    const sbx = await Sandbox.connect("sb-1", conn);
    const seen: string[] = [];
    await assert.rejects(
      sbx.commands.run("sleep 5", { timeoutMs: 1000, onStdout: (d) => seen.push(d) }),
      CommandTimeoutError,
    );
    assert.deepEqual(seen, ["partial"]);
    const body = JSON.parse(String(conn.calls[1].init.body));
    assert.equal(body.timeout, 1);
  });

  it("output split across chunks at any byte is put back together", async () => {
    const text = [
      { type: "start", pid: 1 },
      { type: "stdout", data: "héllo ✓\n" },
      { type: "exit", exit_code: 0 },
    ]
      .map((e) => JSON.stringify(e))
      .join("\n");
    const bytes = new TextEncoder().encode(text);
    const conn = stub((url) => {
      if (!url.pathname.endsWith("/commands")) return json(200, SANDBOX);
      let i = 0;
      return new Response(
        new ReadableStream<Uint8Array>({
          pull(c) {
            if (i >= bytes.length) return c.close();
            c.enqueue(bytes.slice(i, i + 3));
            i += 3;
          },
        }),
      );
    });
    const sbx = await Sandbox.connect("sb-1", conn);
    const result = await sbx.commands.run("x");
    assert.deepEqual(result, { stdout: "héllo ✓\n", stderr: "", exitCode: 0, ok: true });
  });

  it("a stream without an exit is a SandboxError", async () => {
    const conn = stub((url) => (url.pathname.endsWith("/commands") ? ndjson({ type: "start", pid: 1 }) : json(200, SANDBOX)));
    const sbx = await Sandbox.connect("sb-1", conn);
    await assert.rejects(sbx.commands.run("x"), SandboxError);
  });
});

describe("public surface", () => {
  it("exports exactly the curated names, the same from import and require", async () => {
    const esm = await import("sandlot");
    const { createRequire } = await import("node:module");
    const cjs = createRequire(import.meta.url)("sandlot");
    const expected = [
      "AuthenticationError", "BuildError", "BuildStepError", "CapacityError", "CommandExitError", "CommandHandle", "CommandOutput",
      "CommandTimeoutError", "Commands", "ConflictError", "DEFAULT_SHELL", "DEFAULT_URL", "ERRORS", "Files", "ForkList",
      "GuestError", "HostUnavailableError", "Hosts", "ImageError", "ImageNotFoundError", "InvalidArgumentError", "InvalidStateError", "NotFoundError", "PayloadTooLargeError", "PermissionDeniedError", "Sandbox", "SandboxError",
      "Sandboxes", "Sandlot", "SandlotError", "Snapshot", "SnapshotFailedError", "Snapshots", "StorageError",
      "Templates", "Terminal", "Terminals", "VmmError", "WaitTimeoutError", "errorFromPayload", "errorFromResponse",
    ];
    assert.deepEqual(Object.keys(esm).sort(), expected);
    assert.deepEqual(Object.keys(cjs).sort(), expected);
  });
});
