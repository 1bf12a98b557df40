// Sandbox and snapshot actions, each confirmed first; the API's error shown as it words it.

import { call } from "./api";
import { type Sandbox, type Snapshot, store } from "./store";
import { clearError, confirmDialog, field, h, notice, showError } from "./ui";

async function run(what: string, fn: () => Promise<unknown>): Promise<void> {
  clearError();
  try {
    await fn();
    notice(`${what}: done`);
  } catch (e) {
    showError(e);
  }
}

export function sandboxActions(sb: Sandbox): HTMLElement {
  const id = sb.sandbox_id;
  const path = `/v1/sandboxes/${encodeURIComponent(id)}`;
  const buttons: HTMLElement[] = [];
  const add = (label: string, fn: () => void) =>
    buttons.push(h("button", { type: "button", "data-action": label.toLowerCase(),
                               onclick: (e: Event) => { e.stopPropagation(); fn(); } }, label));
  const live = sb.state === "running";
  if (sb.state === "stopped" || sb.state === "failed") return h("span", { class: "actions" });
  if (live) {
    add("Snapshot", async () => {
      const data = await confirmDialog("Snapshot", `Take a snapshot of ${id}?`, [
        field("Name (optional)", h("input", { name: "name", id: "snapshot-name" })),
        field("Keep memory and processes",
          h("input", { type: "checkbox", name: "memory", checked: true })),
      ]);
      if (!data) return;
      const name = String(data.get("name") ?? "").trim() || undefined;
      await run("snapshot", () => call("POST", `${path}/snapshots`,
        { name, memory: data.get("memory") === "on" }));
    });
    add("Fork", async () => {
      const data = await confirmDialog("Fork", `Fork ${id} into copies of its current state?`,
        [field("Children", h("input", { name: "count", type: "number", value: 1, min: 1,
                                        max: 64, id: "fork-count" }))]);
      if (!data) return;
      await run("fork", async () => {
        const r = await call("POST", `${path}/fork`, { count: Number(data.get("count")) });
        if (r.errors?.length) throw new Error(r.errors.map((e: any) => e.error.message)
          .join("; "));
      });
    });
    add("Rollback", async () => {
      const select = h("select", { name: "snapshot", id: "rollback-snapshot" });
      for (const s of store.snapshots.values()) {
        if (s.state === "ready") select.append(h("option", { value: s.snapshot_id },
          s.name ? `${s.name} (${s.snapshot_id})` : s.snapshot_id));
      }
      const data = await confirmDialog("Rollback",
        `Return ${id} to a snapshot's state? What it has now is lost.`,
        [field("Snapshot", select)]);
      if (!data) return;
      await run("rollback", () => call("POST", `${path}/rollback`,
        { snapshot_id: String(data.get("snapshot") ?? "") }));
    });
    add("Pause", async () => {
      if (!await confirmDialog("Pause", `Pause ${id}? Its state is kept; resume brings it back.`))
        return;
      await run("pause", () => call("POST", `${path}/pause`, {}));
    });
  }
  if (sb.state === "paused") {
    add("Resume", async () => {
      if (!await confirmDialog("Resume", `Resume ${id}?`)) return;
      await run("resume", () => call("POST", `${path}/resume`, {}));
    });
  }
  add("Kill", async () => {
    if (!await confirmDialog("Kill", `Kill ${id}? Its VM and disk are gone for good.`)) return;
    await run("kill", () => call("DELETE", path));
  });
  return h("span", { class: "actions" }, ...buttons);
}

export function snapshotActions(s: Snapshot): HTMLElement {
  const path = `/v1/snapshots/${encodeURIComponent(s.snapshot_id)}`;
  if (s.state !== "ready") return h("span", { class: "actions" });
  return h("span", { class: "actions" },
    h("button", { type: "button", "data-action": "start", onclick: async () => {
      const data = await confirmDialog("New sandboxes",
        `Start sandboxes from snapshot ${s.name ?? s.snapshot_id}?`,
        [field("Count", h("input", { name: "count", type: "number", value: 1, min: 1, max: 64,
                                     id: "start-count" }))]);
      if (!data) return;
      await run("start", async () => {
        const r = await call("POST", `${path}/fork`, { count: Number(data.get("count")) });
        if (r.errors?.length) throw new Error(r.errors.map((e: any) => e.error.message)
          .join("; "));
      });
    } }, "Start sandboxes"),
    h("button", { type: "button", "data-action": "delete", onclick: async () => {
      if (!await confirmDialog("Delete", `Delete snapshot ${s.name ?? s.snapshot_id}?`)) return;
      await run("delete", () => call("DELETE", path));
    } }, "Delete"));
}
