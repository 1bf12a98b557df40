// Files on a real VM: strings, bytes, Blobs, web streams and iterables both ways; list,
// exists, stat, makeDir, rename, remove; a 100 MB round trip by streams with matching sha256.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { InvalidArgumentError, NotFoundError, Sandbox } from "sandlot";
import { Cleanup, noServer } from "./helpers.js";

async function collect(stream: ReadableStream<Uint8Array>): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  const reader = stream.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value);
  }
  return new Uint8Array(Buffer.concat(parts));
}

describe("files", { skip: noServer }, () => {
  const cleanup = new Cleanup();
  let sbx: Sandbox;

  before(async () => {
    sbx = cleanup.sandbox(await Sandbox.create({ timeoutMs: 900_000 }));
  });
  after(() => cleanup.run());

  it("write a string, read it as text, bytes, blob and stream", async () => {
    const entry = await sbx.files.write("/tmp/t/hello.txt", "héllo\n");
    assert.equal(entry.path, "/tmp/t/hello.txt");
    assert.equal(entry.type, "file");
    assert.equal(entry.size, 7);
    assert.equal(await sbx.files.read("/tmp/t/hello.txt"), "héllo\n");
    assert.deepEqual(await sbx.files.read("/tmp/t/hello.txt", { format: "bytes" }), new TextEncoder().encode("héllo\n"));
    const blob = await sbx.files.read("/tmp/t/hello.txt", { format: "blob" });
    assert.equal(await blob.text(), "héllo\n");
    const stream = await sbx.files.read("/tmp/t/hello.txt", { format: "stream" });
    assert.equal(new TextDecoder().decode(await collect(stream)), "héllo\n");
  });

  it("write bytes, an ArrayBuffer, a Blob, a ReadableStream and an async iterable", async () => {
    const bytes = new Uint8Array(256).map((_, i) => i);
    await sbx.files.write("/tmp/b/bytes.bin", bytes);
    assert.deepEqual(await sbx.files.read("/tmp/b/bytes.bin", { format: "bytes" }), bytes);
    await sbx.files.write("/tmp/b/buffer.bin", bytes.buffer);
    assert.deepEqual(await sbx.files.read("/tmp/b/buffer.bin", { format: "bytes" }), bytes);
    await sbx.files.write("/tmp/b/blob.txt", new Blob(["from ", "a blob"]));
    assert.equal(await sbx.files.read("/tmp/b/blob.txt"), "from a blob");
    const parts = ["web ", "stream ", "chunks"];
    const web = new ReadableStream<Uint8Array>({
      pull(c) {
        const next = parts.shift();
        if (next === undefined) c.close();
        else c.enqueue(new TextEncoder().encode(next));
      },
    });
    await sbx.files.write("/tmp/b/web.txt", web);
    assert.equal(await sbx.files.read("/tmp/b/web.txt"), "web stream chunks");
    async function* generate() {
      yield "async ";
      yield new TextEncoder().encode("iterable");
    }
    const info = await sbx.files.write("/tmp/b/gen.txt", generate());
    assert.equal(info.size, 14);
    assert.equal(await sbx.files.read("/tmp/b/gen.txt"), "async iterable");
    await assert.rejects(sbx.files.write("/tmp/b/x", 42 as unknown as string), InvalidArgumentError);
  });

  it("write as a user: the user owns the file", async () => {
    const entry = await sbx.files.write("/home/user/work/notes.txt", "mine", { user: "user" });
    assert.equal(entry.owner, "user");
    assert.equal((await sbx.commands.run("echo more >> ~/work/notes.txt && cat ~/work/notes.txt", { user: "user" })).stdout, "minemore\n");
  });

  it("list, exists, stat, makeDir, rename, remove", async () => {
    assert.equal(await sbx.files.makeDir("/tmp/tree/sub/deeper"), true);
    assert.equal(await sbx.files.makeDir("/tmp/tree/sub/deeper"), false);
    await sbx.files.write("/tmp/tree/a.txt", "a");
    await sbx.files.write("/tmp/tree/sub/b.txt", "bb");
    const top = await sbx.files.list("/tmp/tree");
    assert.deepEqual(top.map((e) => `${e.name}:${e.type}`).sort(), ["a.txt:file", "sub:dir"]);
    const deep = await sbx.files.list("/tmp/tree", { depth: 3 });
    assert.deepEqual(
      deep.map((e) => e.path).sort(),
      ["/tmp/tree/a.txt", "/tmp/tree/sub", "/tmp/tree/sub/b.txt", "/tmp/tree/sub/deeper"],
    );
    assert.equal(await sbx.files.exists("/tmp/tree/a.txt"), true);
    assert.equal(await sbx.files.exists("/tmp/tree/nope"), false);
    const stat = await sbx.files.stat("/tmp/tree/sub/b.txt");
    assert.equal(stat.size, 2);
    assert.equal(stat.owner, "root");
    assert.equal((await sbx.files.stat("/tmp/tree/sub")).type, "dir");
    const moved = await sbx.files.rename("/tmp/tree/a.txt", "/tmp/tree/sub/moved.txt");
    assert.equal(moved.path, "/tmp/tree/sub/moved.txt");
    assert.equal(await sbx.files.exists("/tmp/tree/a.txt"), false);
    assert.equal(await sbx.files.read("/tmp/tree/sub/moved.txt"), "a");
    await sbx.files.remove("/tmp/tree/sub/moved.txt");
    assert.equal(await sbx.files.exists("/tmp/tree/sub/moved.txt"), false);
    await sbx.files.remove("/tmp/tree");
    assert.equal(await sbx.files.exists("/tmp/tree"), false);
  });

  it("errors: missing files, directories, relative paths", async () => {
    await assert.rejects(sbx.files.read("/tmp/missing.txt"), NotFoundError);
    await assert.rejects(sbx.files.stat("/tmp/missing.txt"), NotFoundError);
    await assert.rejects(sbx.files.read("/tmp"), InvalidArgumentError);
    await assert.rejects(sbx.files.list("tmp"), InvalidArgumentError);
  });

  it("100 MB round trip by streams, sha256 matching, never whole in memory", { timeout: 900_000 }, async () => {
    const MiB = 1 << 20;
    const sizeMb = 100;
    const block = new Uint8Array(MiB);
    for (let i = 0; i < MiB; i++) block[i] = (i * 2654435761) >>> 24;
    const sent = createHash("sha256");
    let i = 0;
    // Each chunk is made when the upload pulls it: the file never exists whole on this side.
    const source = new ReadableStream<Uint8Array>({
      pull(controller) {
        if (i === sizeMb) return controller.close();
        const chunk = new Uint8Array(MiB);
        chunk.set(block.subarray(i));
        chunk.set(block.subarray(0, i), MiB - i);
        sent.update(chunk);
        controller.enqueue(chunk);
        i++;
      },
    });
    const info = await sbx.files.write("/root/big.bin", source);
    const digest = sent.digest("hex");
    assert.equal(info.size, sizeMb * MiB);
    const guest = await sbx.commands.run("sha256sum /root/big.bin", { timeoutMs: 300_000 });
    assert.equal(guest.stdout.split(" ")[0], digest);

    const back = createHash("sha256");
    let total = 0;
    let largest = 0;
    const reader = (await sbx.files.read("/root/big.bin", { format: "stream" })).getReader();
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      back.update(value);
      total += value.length;
      largest = Math.max(largest, value.length);
    }
    assert.equal(total, sizeMb * MiB);
    assert.ok(largest <= 4 * MiB, `a chunk of ${largest} bytes`);
    assert.equal(back.digest("hex"), digest);
    await sbx.files.remove("/root/big.bin");
  });

  it("a read stream cancelled early releases the download", async () => {
    await sbx.commands.run("head -c 20000000 /dev/zero > /root/zeros.bin", { check: true });
    const stream = await sbx.files.read("/root/zeros.bin", { format: "stream" });
    const reader = stream.getReader();
    const first = await reader.read();
    assert.ok(!first.done && first.value.length > 0);
    await reader.cancel();
    assert.equal((await sbx.commands.run("echo alive")).stdout, "alive\n");
    assert.equal(await sbx.files.read("/tmp/b/gen.txt"), "async iterable");
  });
});
