// Small DOM helpers, the error banner and the confirmation dialog.

type Attrs = Record<string, string | number | boolean | EventListener | undefined>;

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K, attrs: Attrs = {}, ...children: (Node | string | null | undefined)[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === false) continue;
    if (typeof value === "function") el.addEventListener(name.replace(/^on/, ""), value);
    else if (name === "class") el.className = String(value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  for (const c of children) if (c !== null && c !== undefined) el.append(c);
  return el;
}

export function showError(e: unknown): void {
  const bar = document.getElementById("error");
  if (!bar) return;
  bar.textContent = e instanceof Error ? e.message : String(e);
  bar.hidden = false;
}

export function clearError(): void {
  const bar = document.getElementById("error");
  if (bar) bar.hidden = true;
}

export function notice(text: string): void {
  const bar = document.getElementById("notice");
  if (!bar) return;
  bar.textContent = text;
  bar.hidden = false;
  setTimeout(() => (bar.hidden = true), 4000);
}

/** A confirmation with optional fields; resolves to their values, or null if cancelled. */
export function confirmDialog(title: string, text: string,
                              fields: HTMLElement[] = []): Promise<FormData | null> {
  return new Promise((resolve) => {
    const form = h("form", { method: "dialog", class: "dialog" },
      h("h3", {}, title), h("p", {}, text), ...fields,
      h("div", { class: "buttons" },
        h("button", { type: "button", value: "cancel", id: "dialog-cancel" }, "Cancel"),
        h("button", { type: "submit", value: "ok", id: "dialog-ok", class: "primary" },
          "Confirm")));
    const dialog = h("dialog", {}, form);
    document.body.append(dialog);
    const done = (ok: boolean) => {
      const data = new FormData(form);
      dialog.close();
      dialog.remove();
      resolve(ok ? data : null);
    };
    form.addEventListener("submit", (ev) => { ev.preventDefault(); done(true); });
    form.querySelector("#dialog-cancel")!.addEventListener("click", () => done(false));
    dialog.addEventListener("cancel", () => done(false));
    dialog.showModal();
  });
}

export function field(label: string, input: HTMLElement): HTMLElement {
  return h("label", { class: "field" }, label, input);
}

export function age(iso: string | null | undefined): string {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v < 10 && i ? 1 : 0)} ${units[i]}`;
}
