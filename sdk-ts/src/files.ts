/**
 * Reading and writing files in a sandbox: strings, bytes, Blobs and web `ReadableStream`s, so a
 * large file is streamed and never held whole in memory.
 *
 * @module
 */

import { InvalidArgumentError } from "./errors.js";
import { Api, seg } from "./http.js";
import { toEntryInfo, type EntryInfo, type Schemas } from "./models.js";

/**
 * What {@link Files.write} accepts: text (UTF-8), bytes, a `Blob` (e.g. from `fs.openAsBlob`),
 * or a stream of byte chunks: a web `ReadableStream` or any (async) iterable such as a Node
 * `fs.ReadStream`. Streams are sent as they are read.
 */
export type WriteData =
  | string
  | Uint8Array
  | ArrayBuffer
  | Blob
  | ReadableStream<Uint8Array>
  | AsyncIterable<Uint8Array | string>
  | Iterable<Uint8Array>;

/** The forms {@link Files.read} returns a file in. */
export type ReadFormat = "text" | "bytes" | "blob" | "stream";

function path_(path: string): string {
  if (typeof path !== "string" || !path.startsWith("/")) {
    throw new InvalidArgumentError(`sandbox paths must be absolute, got ${JSON.stringify(path)}`);
  }
  return path;
}

function chunkBytes(chunk: unknown): Uint8Array {
  if (typeof chunk === "string") return new TextEncoder().encode(chunk);
  if (chunk instanceof Uint8Array) return chunk;
  if (chunk instanceof ArrayBuffer) return new Uint8Array(chunk);
  if (ArrayBuffer.isView(chunk)) return new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength);
  throw new InvalidArgumentError(`upload chunks must be bytes or strings, got ${typeof chunk}`);
}

/** A web stream that pulls from an (async) iterator one chunk at a time. */
function iterableStream(iterable: AsyncIterable<unknown> | Iterable<unknown>): ReadableStream<Uint8Array> {
  const iterator =
    Symbol.asyncIterator in iterable
      ? (iterable as AsyncIterable<unknown>)[Symbol.asyncIterator]()
      : (iterable as Iterable<unknown>)[Symbol.iterator]();
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      const { done, value } = await iterator.next();
      if (done) controller.close();
      else controller.enqueue(chunkBytes(value));
    },
    async cancel() {
      await iterator.return?.();
    },
  });
}

/** The request body for `data`: in-memory data as is, anything else as a web stream. */
function uploadBody(data: WriteData): string | Uint8Array | Blob | ReadableStream<Uint8Array> {
  if (typeof data === "string" || data instanceof Uint8Array || data instanceof Blob) return data;
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (data instanceof ReadableStream) return data;
  if (data && typeof data === "object" && (Symbol.asyncIterator in data || Symbol.iterator in data)) {
    return iterableStream(data as AsyncIterable<unknown>);
  }
  throw new InvalidArgumentError(
    "cannot upload this value: pass a string, bytes, a Blob, a ReadableStream or an iterable of byte chunks",
  );
}

/** `sbx.files`: the sandbox's file system. Paths are absolute guest paths. */
export class Files {
  /** @internal */
  constructor(
    private readonly api: Api,
    private readonly sandboxId: string,
  ) {}

  private get base(): string {
    return `/v1/sandboxes/${seg(this.sandboxId)}/files`;
  }

  /**
   * Read a file as text (UTF-8, the default), bytes, a Blob, or a web `ReadableStream` of its
   * bytes that downloads as it is read (cancel it to stop early).
   *
   * ```ts
   * const text = await sbx.files.read("/etc/hostname");
   * const stream = await sbx.files.read("/data/big.bin", { format: "stream" });
   * ```
   * @throws {NotFoundError} if there is no such file; {@link InvalidArgumentError} for a directory.
   */
  read(path: string, options?: { format?: "text" }): Promise<string>;
  read(path: string, options: { format: "bytes" }): Promise<Uint8Array>;
  read(path: string, options: { format: "blob" }): Promise<Blob>;
  read(path: string, options: { format: "stream" }): Promise<ReadableStream<Uint8Array>>;
  async read(
    path: string,
    options: { format?: ReadFormat } = {},
  ): Promise<string | Uint8Array | Blob | ReadableStream<Uint8Array>> {
    const format = options.format ?? "text";
    if (!["text", "bytes", "blob", "stream"].includes(format)) {
      throw new InvalidArgumentError(`format must be text, bytes, blob or stream, got ${JSON.stringify(format)}`);
    }
    const stream = await this.api.stream({ method: "GET", path: this.base, query: { path: path_(path) } });
    if (format === "stream") return stream;
    const response = new Response(stream);
    if (format === "text") return response.text();
    if (format === "blob") return response.blob();
    return new Uint8Array(await response.arrayBuffer());
  }

  /**
   * Write `data` to `path`, creating parent directories, and return the new entry. Streams and
   * iterables are sent as they are read, never held whole in memory. `user` owns the file.
   * `metadata` (keys lowercased; keys HTTP tokens, values printable ASCII) is kept with the
   * file as extended attributes, shown by `stat` and `list`, kept by `rename` and replaced by
   * the next write (E2B's file metadata).
   */
  async write(path: string, data: WriteData, options: { user?: string; metadata?: Record<string, string> } = {}): Promise<EntryInfo> {
    const body = uploadBody(data);
    const info = await this.api.call<Schemas["FileInfo"]>({
      method: "PUT",
      path: this.base,
      query: { path: path_(path), user: options.user ?? "root" },
      headers: metadataHeaders(options.metadata),
      body,
      timeoutMs: null,
    });
    return toEntryInfo(info);
  }

  /** The entries under directory `path`, down to `depth` levels (default 1). */
  async list(path: string, options: { depth?: number } = {}): Promise<EntryInfo[]> {
    const data = await this.api.call<Schemas["FileList"]>({
      method: "GET",
      path: `${this.base}/list`,
      query: { path: path_(path), depth: Math.trunc(options.depth ?? 1) },
    });
    return (data?.entries ?? []).map(toEntryInfo);
  }

  /** Whether `path` exists. */
  async exists(path: string): Promise<boolean> {
    const data = await this.api.call<Schemas["Exists"]>({
      method: "GET",
      path: `${this.base}/exists`,
      query: { path: path_(path) },
    });
    return Boolean(data?.exists);
  }

  /** Information about `path`. @throws {NotFoundError} if it does not exist. */
  async stat(path: string): Promise<EntryInfo> {
    const data = await this.api.call<Schemas["FileInfo"]>({
      method: "GET",
      path: `${this.base}/stat`,
      query: { path: path_(path) },
    });
    return toEntryInfo(data);
  }

  /** Delete a file, or a directory recursively. */
  async remove(path: string): Promise<void> {
    await this.api.call({ method: "DELETE", path: this.base, query: { path: path_(path) } });
  }

  /** Create directory `path` and its parents; `false` if it already existed. */
  async makeDir(path: string, options: { user?: string } = {}): Promise<boolean> {
    const data = await this.api.call<Schemas["MkdirResult"]>({
      method: "POST",
      path: `${this.base}/mkdir`,
      json: { path: path_(path), user: options.user ?? "root" } satisfies Schemas["MkdirBody"],
    });
    return data?.created ?? true;
  }

  /** Move `src` to `dst`; returns the entry at `dst`. */
  async rename(src: string, dst: string): Promise<EntryInfo> {
    const data = await this.api.call<Schemas["FileInfo"]>({
      method: "POST",
      path: `${this.base}/rename`,
      json: { src: path_(src), dst: path_(dst) },
    });
    return toEntryInfo(data);
  }
}

/** A file's metadata as the `X-Metadata-<key>` headers the server reads. */
function metadataHeaders(metadata: Record<string, string> | undefined): Record<string, string> {
  const headers: Record<string, string> = {};
  for (const [key, value] of Object.entries(metadata ?? {})) {
    if (!/^[A-Za-z0-9!#$%&'*+.^_`|~-]+$/.test(key) || typeof value !== "string" || !/^[\x20-\x7e]*$/.test(value)) {
      throw new InvalidArgumentError(`file metadata ${JSON.stringify(key)}: keys are letters, digits and !#$%&'*+-.^_\`|~; values printable US-ASCII`);
    }
    headers[`X-Metadata-${key}`] = value;
  }
  return headers;
}
