// The deployment's hosts (admin keys): state, room, sandboxes; drain and activate.

import { call } from "./api";
import { clearError, confirmDialog, h, showError } from "./ui";

type Host = { id: string; url: string; state: string; cores: number; memory_mb: number;
  memory_free_mb: number; disk_free_mb: number; slots: number; sandboxes: number;
  heartbeat_age_s: number };

export function hostsView(root: HTMLElement): () => void {
  const body = h("tbody");
  const note = h("p", { class: "muted" });
  root.append(h("div", { class: "toolbar" }, h("h2", {}, "Hosts")), note,
    h("table", { class: "list", id: "hosts" },
      h("thead", {}, h("tr", {}, ...["Host", "State", "URL", "Sandboxes", "Slots",
        "Memory free", "Disk free", "Heartbeat", ""].map((c) => h("th", {}, c)))), body));
  let gone = false;
  const load = async () => {
    try {
      const r = await call<{ hosts: Host[]; this_host: string }>("GET", "/v1/hosts");
      note.textContent = `This console is connected to ${r.this_host}.`;
      body.replaceChildren(...r.hosts.map((host) => h("tr", { "data-id": host.id },
        h("td", {}, host.id), h("td", {}, h("span", { class: `state ${host.state}` }, host.state)),
        h("td", {}, host.url), h("td", {}, String(host.sandboxes)), h("td", {}, String(host.slots)),
        h("td", {}, `${host.memory_free_mb} / ${host.memory_mb} MiB`),
        h("td", {}, `${host.disk_free_mb} MiB`), h("td", {}, `${host.heartbeat_age_s.toFixed(0)}s ago`),
        h("td", {}, action(host)))));
    } catch (e) {
      showError(e);
    }
  };
  const action = (host: Host) => {
    const verb = host.state === "active" ? "drain" : "activate";
    if (host.state === "lost") return h("span");
    return h("button", { type: "button", "data-action": verb, onclick: async () => {
      const text = verb === "drain"
        ? `Drain ${host.id}? It takes no new sandboxes; those it runs run to their end.`
        : `Activate ${host.id}? It takes new sandboxes again.`;
      if (!await confirmDialog(verb === "drain" ? "Drain" : "Activate", text)) return;
      clearError();
      try {
        await call("POST", `/v1/hosts/${encodeURIComponent(host.id)}/${verb}`);
        await load();
      } catch (e) {
        showError(e);
      }
    } }, verb === "drain" ? "Drain" : "Activate");
  };
  load();
  const tick = setInterval(() => { if (!gone) load(); }, 10000);  // hosts are not in the feed
  return () => { gone = true; clearInterval(tick); };
}
