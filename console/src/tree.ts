// The tree: templates, snapshots and the sandboxes started, forked or rolled back from them.
// Zoom and pan with the mouse; a double click folds a node's descendants; a click opens it.

import cytoscape from "cytoscape";
import dagre from "cytoscape-dagre";

import { snapshotActions } from "./actions";
import { onChange, store } from "./store";
import { age, bytes, h } from "./ui";

cytoscape.use(dagre);

type El = cytoscape.ElementDefinition;

/** Nodes and edges of what the key sees (exported for the tests and the outline). */
export function graph(showStopped: boolean): El[] {
  const els: El[] = [];
  const ids = new Set<string>();
  const node = (id: string, kind: string, label: string, state = "") => {
    ids.add(id);
    els.push({ data: { id, kind, label, state }, classes: `${kind} ${state}` });
  };
  const edges: [string, string, string][] = [];
  for (const t of store.templates) node(`t:${t.name}`, "template", t.name);
  for (const s of store.snapshots.values()) {
    const size = s.stored_bytes != null ? `${bytes(s.stored_bytes)} of ${bytes(s.size_bytes)}` : "";
    node(`n:${s.snapshot_id}`, "snapshot",
      `${s.name ?? s.snapshot_id}\n${s.memory ? "memory" : "fs only"} ${size}`, s.state);
    if (s.sandbox_id) edges.push([`s:${s.sandbox_id}`, `n:${s.snapshot_id}`, "snapshot"]);
    else if (s.template) edges.push([`t:${s.template}`, `n:${s.snapshot_id}`, ""]);
  }
  const taken = new Set([...store.snapshots.values()].map((s) => s.sandbox_id));
  for (const sb of store.sandboxes.values()) {
    const ended = ["stopped", "failed", "lost"].includes(sb.state);
    // an ended sandbox stays while a snapshot of it does: it links the snapshot to its source
    if (ended && !showStopped && !taken.has(sb.sandbox_id)) continue;
    node(`s:${sb.sandbox_id}`, "sandbox", `${sb.sandbox_id}\n${sb.state}`, sb.state);
    // A fork child's snapshot_id is its fork's own (not listed); a listed one it points to
    // was rolled back to (or restored from, for a sandbox not forked).
    const snap = sb.snapshot_id ? store.snapshots.get(sb.snapshot_id) : undefined;
    const back = snap && (sb.forked_from || snap.sandbox_id === sb.sandbox_id);
    if (sb.forked_from) edges.push([`s:${sb.forked_from}`, `s:${sb.sandbox_id}`, "fork"]);
    if (snap) edges.push([`n:${snap.snapshot_id}`, `s:${sb.sandbox_id}`,
                          back ? "rollback" : "restore"]);
    else if (!sb.forked_from && sb.template) {
      edges.push([`t:${sb.template}`, `s:${sb.sandbox_id}`, ""]);
    }
  }
  for (const [source, target, label] of edges) {
    if (ids.has(source) && ids.has(target)) {
      els.push({ data: { id: `${source}>${target}`, source, target, label } });
    }
  }
  return els;
}

const STYLE: cytoscape.StylesheetStyle[] = [
  { selector: "node", style: { label: "data(label)", "text-wrap": "wrap", "font-size": 10,
    "text-valign": "center", "text-halign": "center", width: 150, height: 40, shape: "round-rectangle",
    "background-color": "#e8eef7", "border-width": 1, "border-color": "#8aa" } },
  { selector: "node.template", style: { "background-color": "#d9ead3", shape: "hexagon" } },
  { selector: "node.snapshot", style: { "background-color": "#fff2cc", shape: "barrel" } },
  { selector: "node.running", style: { "border-color": "#2a7", "border-width": 3 } },
  { selector: "node.paused", style: { "border-color": "#c80", "border-width": 3 } },
  { selector: "node.stopped, node.failed, node.lost, node.deleted",
    style: { opacity: 0.5 } },
  { selector: "node.folded", style: { "border-style": "double", "border-width": 5 } },
  { selector: "edge", style: { width: 1.5, "curve-style": "bezier", "target-arrow-shape": "triangle",
    label: "data(label)", "font-size": 8, "line-color": "#999", "target-arrow-color": "#999" } },
  { selector: "node:selected", style: { "border-color": "#06c", "border-width": 4 } },
];

export function treeView(root: HTMLElement): () => void {
  const stopped = h("input", { type: "checkbox", id: "show-stopped" });
  const fit = h("button", { type: "button", id: "fit" }, "Fit");
  const panel = h("aside", { class: "panel", id: "tree-panel" },
    h("p", { class: "muted" }, "Click a node to open it; double-click folds what comes from it."));
  const canvas = h("div", { id: "tree" });
  root.append(h("div", { class: "toolbar" }, h("h2", {}, "Tree"),
    h("label", {}, stopped, " show ended sandboxes"), fit),
    h("div", { class: "tree-wrap" }, canvas, panel));
  const cy = cytoscape({ container: canvas, style: STYLE,
                         minZoom: 0.05, maxZoom: 3 });
  (window as any).sandlotTree = cy;  // for the browser tests
  const folded = new Set<string>();
  let shape = "";

  const render = () => {
    const els = graph(stopped.checked);
    const key = els.map((e) => e.data.id).sort().join(",");
    cy.batch(() => {
      const have = new Set(cy.elements().map((e) => e.id()));
      const want = new Set(els.map((e) => e.data.id!));
      cy.elements().filter((e) => !want.has(e.id())).remove();
      for (const el of els) {
        if (have.has(el.data.id!)) {
          const e = cy.getElementById(el.data.id!);
          e.data(el.data);
          if (el.classes) e.classes(String(el.classes) + (folded.has(e.id()) ? " folded" : ""));
        } else cy.add(el);
      }
      cy.nodes().style("display", "element");
      for (const id of folded) cy.getElementById(id).successors().style("display", "none");
    });
    if (key !== shape) {
      shape = key;
      cy.layout({ name: "dagre", rankDir: "LR", nodeSep: 12, rankSep: 60,
                  animate: false } as any).run();
    }
  };
  cy.on("tap", "node", (ev) => open(ev.target.id()));
  cy.on("dbltap", "node", (ev) => {
    const id = ev.target.id();
    if (folded.has(id)) folded.delete(id);
    else folded.add(id);
    render();
  });
  const open = (id: string) => {
    const [kind, rest] = [id.slice(0, 1), id.slice(2)];
    if (kind === "s") {
      location.hash = `#/sandbox/${rest}`;
    } else if (kind === "n") {
      const s = store.snapshots.get(rest);
      if (!s) return;
      panel.replaceChildren(h("h3", {}, s.name ?? s.snapshot_id),
        h("dl", {}, h("dt", {}, "id"), h("dd", {}, s.snapshot_id),
          h("dt", {}, "state"), h("dd", {}, s.state),
          h("dt", {}, "kind"), h("dd", {}, s.memory ? "memory and disk" : "filesystem only"),
          h("dt", {}, "stored"), h("dd", {}, `${bytes(s.stored_bytes)} of ${bytes(s.size_bytes)}`),
          h("dt", {}, "from"), h("dd", {}, s.sandbox_id ?? s.template ?? ""),
          h("dt", {}, "age"), h("dd", {}, age(s.created_at))),
        snapshotActions(s));
    } else {
      const t = store.templates.find((x) => x.name === rest);
      if (!t) return;
      panel.replaceChildren(h("h3", {}, `template ${t.name}`),
        h("dl", {}, h("dt", {}, "build"), h("dd", {}, t.hash),
          h("dt", {}, "default size"), h("dd", {}, `${t.cpus} CPU, ${t.memory_mb} MiB`)));
    }
  };
  stopped.addEventListener("change", render);
  fit.addEventListener("click", () => cy.fit(undefined, 20));
  render();
  const off = onChange(render);
  return () => { off(); cy.destroy(); delete (window as any).sandlotTree; };
}
