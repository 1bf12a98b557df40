// The sandboxes: a live table with filters and actions.

import { sandboxActions } from "./actions";
import { onChange, type Sandbox, store } from "./store";
import { age, h } from "./ui";

const STATES = ["", "running", "paused", "starting", "stopped", "failed", "lost"];

export function source(sb: Sandbox): string {
  if (sb.forked_from) return `fork of ${sb.forked_from}`;
  if (sb.snapshot_id) {
    const snap = store.snapshots.get(sb.snapshot_id);
    return `snapshot ${snap?.name ?? sb.snapshot_id}`;
  }
  return sb.template ? `template ${sb.template}` : "";
}

function timeLeft(sb: Sandbox): string {
  if (!sb.expires_at || sb.state !== "running") return sb.timeout ? `${sb.timeout}s` : "none";
  const s = Math.max(0, Math.round((Date.parse(sb.expires_at) - Date.now()) / 1000));
  return `${s}s left`;
}

export function sandboxesView(root: HTMLElement): () => void {
  const text = h("input", { type: "search", id: "filter", placeholder: "id, source, host, metadata" });
  const state = h("select", { id: "state-filter" },
    ...STATES.map((s) => h("option", { value: s }, s || "running and paused")));
  const body = h("tbody");
  const count = h("span", { class: "muted", id: "count" });
  root.append(
    h("div", { class: "toolbar" }, h("h2", {}, "Sandboxes"), text, state, count),
    h("table", { class: "list", id: "sandboxes" },
      h("thead", {}, h("tr", {}, ...["Sandbox", "State", "Source", "Host", "Age", "Timeout",
        "CPUs", "Memory", ""].map((c) => h("th", {}, c)))),
      body));

  const render = () => {
    const q = text.value.trim().toLowerCase();
    const want = state.value;
    const rows = [...store.sandboxes.values()]
      .filter((sb) => want ? sb.state === want : ["running", "paused", "starting"].includes(sb.state))
      .filter((sb) => !q || [sb.sandbox_id, source(sb), sb.host ?? "",
        JSON.stringify(sb.metadata)].some((v) => v.toLowerCase().includes(q)))
      .sort((a, b) => b.created_at.localeCompare(a.created_at));
    body.replaceChildren(...rows.map((sb) => h("tr", { "data-id": sb.sandbox_id,
                                                       "data-state": sb.state },
      h("td", {}, h("a", { href: `#/sandbox/${sb.sandbox_id}` }, sb.sandbox_id)),
      h("td", {}, h("span", { class: `state ${sb.state}`, title: sb.error ?? "" }, sb.state)),
      h("td", {}, source(sb)),
      h("td", {}, sb.host ?? ""),
      h("td", {}, age(sb.created_at)),
      h("td", {}, timeLeft(sb)),
      h("td", {}, String(sb.cpus)),
      h("td", {}, `${sb.memory_mb} MiB`),
      h("td", {}, sandboxActions(sb)))));
    count.textContent = `${rows.length} shown`;
  };
  text.addEventListener("input", render);
  state.addEventListener("change", render);
  render();
  const off = onChange(render);
  const tick = setInterval(render, 5000);  // ages and time left; the data comes by events
  return () => { off(); clearInterval(tick); };
}
