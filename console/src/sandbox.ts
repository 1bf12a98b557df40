// One sandbox: its record and actions, a terminal (the PTY WebSocket), files, metrics, ports.

import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import uPlot from "uplot";

import { sandboxActions } from "./actions";
import { ApiError, call, key, raw } from "./api";
import { source } from "./sandboxes";
import { onChange, store } from "./store";
import { age, bytes, clearError, h, showError } from "./ui";

export function sandboxView(root: HTMLElement, id: string): () => void {
  const base = `/v1/sandboxes/${encodeURIComponent(id)}`;
  const info = h("div", { class: "info", id: "sandbox-info" });
  const term = h("div", { id: "terminal" });
  const termBar = h("div", { class: "toolbar" }, h("h3", {}, "Terminal"));
  const files = h("div", { id: "files" });
  const chart = h("div", { id: "metrics" });
  const ports = h("div", { id: "ports" });
  root.append(h("div", { class: "toolbar" }, h("h2", {}, h("a", { href: "#/sandboxes" },
    "Sandboxes"), " / ", id)), info,
    h("section", {}, termBar, term),
    h("div", { class: "columns" },
      h("section", {}, h("h3", {}, "Files"), files),
      h("section", {}, h("h3", {}, "Metrics"), chart, h("h3", {}, "Ports"), ports)));

  const renderInfo = () => {
    const sb = store.sandboxes.get(id);
    if (!sb) { info.textContent = "…"; return; }
    info.replaceChildren(h("dl", {},
      ...[["state", sb.state], ["source", source(sb)], ["host", sb.host ?? ""],
        ["age", age(sb.created_at)], ["timeout", `${sb.timeout}s (${sb.on_timeout})`],
        ["size", `${sb.cpus} CPU, ${sb.memory_mb} MiB`],
        ["metadata", JSON.stringify(sb.metadata)], ["error", sb.error ?? ""]]
        .filter(([, v]) => v).flatMap(([k, v]) => [h("dt", {}, k), h("dd", { "data-field": k }, v)])),
      sandboxActions(sb));
  };
  renderInfo();
  const off = onChange(renderInfo);
  const stops = [off, terminal(base, term, termBar), fileBrowser(base, files),
                 metrics(base, chart), portLinks(base, ports)];
  return () => stops.forEach((f) => f());
}

function terminal(base: string, el: HTMLElement, bar: HTMLElement): () => void {
  const t = new Terminal({ convertEol: false, cursorBlink: true, fontSize: 13, scrollback: 5000 });
  const fit = new FitAddon();
  t.loadAddon(fit);
  t.open(el);
  (window as any).sandlotTerminal = t;  // for the browser tests
  fit.fit();
  let pid: number | null = null;  // the shell's: a new socket attaches to it, if it runs
  let ws: WebSocket | null = null;
  let gone = false;
  const encoder = new TextEncoder();
  const status = h("span", { class: "muted", id: "terminal-status" });
  const again = h("button", { type: "button", id: "terminal-reconnect",
                              onclick: () => connect() }, "Reconnect");
  bar.append(status, again);

  // GET /v1/sandboxes/{id}/pty: the key goes in the first message, never in the URL
  const connect = async () => {
    ws?.close(1000);  // the shell goes on: the new socket attaches to it
    ws = null;
    clearError();
    try {
      if (pid !== null && !(await running(pid))) pid = null;
    } catch (e) {
      showError(e);
      status.textContent = "disconnected";
      return;
    }
    if (gone) return;
    status.textContent = pid === null ? "starting a shell…" : `shell ${pid}: connecting`;
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const sock = new WebSocket(`${scheme}//${location.host}${base}/pty`);
    sock.binaryType = "arraybuffer";
    ws = sock;
    sock.onopen = () => sock.send(JSON.stringify(
      { api_key: key(), cols: t.cols, rows: t.rows, ...(pid === null ? {} : { pid }) }));
    sock.onmessage = (ev: MessageEvent) => {
      if (sock !== ws) return;
      if (typeof ev.data !== "string") {
        t.write(new Uint8Array(ev.data as ArrayBuffer));
        return;
      }
      const msg = JSON.parse(ev.data);
      if (msg.type === "start") {
        pid = msg.pid;
        t.reset();  // the socket replays the terminal's output from its start
        status.textContent = `shell ${pid}`;
      } else if (msg.type === "exit") {
        status.textContent = `exited (${msg.exit_code})`;
        pid = null;
      } else if (msg.type === "error") {
        showError(new ApiError(0, msg.error.type, msg.error.message));
      }
    };
    sock.onclose = (ev: CloseEvent) => {
      if (sock !== ws || gone) return;
      ws = null;
      if (ev.code !== 1000) status.textContent = "disconnected";
    };
  };
  const running = async (p: number) => {
    const r = await call<{ processes: { pid: number; running: boolean }[] }>(
      "GET", `${base}/commands`);
    return r.processes.some((x) => x.pid === p && x.running);
  };
  const send = (data: string | Uint8Array) => {
    if (ws?.readyState === WebSocket.OPEN && pid !== null) ws.send(data);
  };
  t.onData((data) => send(encoder.encode(data)));
  t.onResize(({ cols, rows }) => send(JSON.stringify({ type: "resize", cols, rows })));
  const observer = new ResizeObserver(() => fit.fit());
  observer.observe(el);
  connect();
  return () => {
    gone = true;
    observer.disconnect();
    ws?.close(1000);
    t.dispose();
    delete (window as any).sandlotTerminal;
  };
}

function fileBrowser(base: string, el: HTMLElement): () => void {
  const path = h("input", { id: "files-path", value: "/root" });
  const body = h("tbody");
  const upload = h("input", { type: "file", id: "files-upload" });
  const list = async () => {
    clearError();
    try {
      const r = await call<{ entries: any[] }>(
        "GET", `${base}/files/list?path=${encodeURIComponent(path.value)}`);
      const up = path.value.replace(/\/[^/]+\/?$/, "") || "/";
      body.replaceChildren(
        h("tr", {}, h("td", {}, h("a", { href: "#", onclick: (e: Event) => {
          e.preventDefault(); path.value = up; list(); } }, "..")), h("td"), h("td")),
        ...r.entries.sort((a, b) => (a.type === "dir" ? 0 : 1) - (b.type === "dir" ? 0 : 1)
          || a.name.localeCompare(b.name)).map((f) => h("tr", { "data-name": f.name },
          h("td", {}, f.type === "dir"
            ? h("a", { href: "#", onclick: (e: Event) => { e.preventDefault(); path.value = f.path; list(); } }, `${f.name}/`)
            : f.name),
          h("td", {}, f.type === "dir" ? "" : bytes(f.size)),
          h("td", {}, f.type === "file" ? h("button", { type: "button", "data-action": "download",
            onclick: () => download(f.path, f.name) }, "Download") : ""))));
    } catch (e) {
      showError(e);
    }
  };
  const download = async (p: string, name: string) => {
    try {
      const r = await raw("GET", `${base}/files?path=${encodeURIComponent(p)}`);
      const url = URL.createObjectURL(await r.blob());
      const a = h("a", { href: url, download: name });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (e) {
      showError(e);
    }
  };
  upload.addEventListener("change", async () => {
    const file = upload.files?.[0];
    if (!file) return;
    const target = `${path.value.replace(/\/$/, "")}/${file.name}`;
    try {
      await raw("PUT", `${base}/files?path=${encodeURIComponent(target)}`, { body: file });
      upload.value = "";
      await list();
    } catch (e) {
      showError(e);
    }
  });
  el.append(h("div", { class: "toolbar" }, path,
    h("button", { type: "button", id: "files-list", onclick: () => list() }, "List"),
    h("label", {}, "Upload ", upload)), h("table", { class: "list" }, body));
  list();
  return () => undefined;
}

function metrics(base: string, el: HTMLElement): () => void {
  const opts: uPlot.Options = {
    width: 460, height: 200,
    series: [{}, { label: "CPU %", stroke: "#c33", scale: "%" },
             { label: "memory MiB", stroke: "#36c", scale: "mb" }],
    axes: [{}, { scale: "%" }, { scale: "mb", side: 1 }],
    scales: { x: { time: true } },
  };
  const plot = new uPlot(opts, [[], [], []], el);
  const load = async () => {
    try {
      const r = await call<{ metrics: any[] }>("GET", `${base}/metrics`);
      plot.setData([r.metrics.map((m) => m.timestamp), r.metrics.map((m) => m.cpu_used_pct),
                    r.metrics.map((m) => m.mem_used / 1048576)]);
    } catch {
      /* not running: the chart stays as it was */
    }
  };
  load();
  const tick = setInterval(load, 15000);  // samples are taken every few seconds on the host
  return () => { clearInterval(tick); plot.destroy(); };
}

function portLinks(base: string, el: HTMLElement): () => void {
  const port = h("input", { type: "number", min: 1, max: 65535, id: "port", placeholder: "port" });
  const links = h("ul", { id: "port-links" });
  const expose = async () => {
    clearError();
    try {
      const r = await call("POST", `${base}/ports`, { port: Number(port.value) });
      links.append(h("li", {}, `${port.value} → `,
        h("a", { href: `http://${r.address}/`, target: "_blank", rel: "noreferrer" },
          `http://${r.address}/`)));
    } catch (e) {
      showError(e);
    }
  };
  el.append(h("div", { class: "toolbar" }, port,
    h("button", { type: "button", onclick: expose }, "Expose")), links);
  return () => undefined;
}
