// sandlot's console: sign in with an API key, then sandboxes, the tree, one sandbox, hosts.

import "@xterm/xterm/css/xterm.css";
import "uplot/dist/uPlot.min.css";
import "./style.css";

import { ApiError, call, key, setKey } from "./api";
import { hostsView } from "./hosts";
import { sandboxesView } from "./sandboxes";
import { sandboxView } from "./sandbox";
import { close, follow, onChange, store } from "./store";
import { clearError, h } from "./ui";
import { treeView } from "./tree";

const app = document.getElementById("app")!;
let leave: (() => void) | null = null;

function signIn(message = ""): void {
  close();
  leave?.();
  leave = null;
  const input = h("input", { type: "password", id: "key", name: "key", autocomplete: "off",
                             placeholder: "API key", required: true });
  const error = h("p", { class: "error", id: "login-error", role: "alert" }, message);
  const form = h("form", { class: "login", id: "login" },
    h("h1", {}, "sandlot"), h("p", { class: "muted" }, "Sign in with an API key."),
    input, h("button", { type: "submit", class: "primary" }, "Sign in"), error);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    error.textContent = "";
    try {
      await call("GET", "/v1/sandboxes", undefined, input.value.trim());
      setKey(input.value.trim());
      start();
    } catch (e) {
      error.textContent = e instanceof ApiError ? e.message : String(e);
    }
  });
  app.replaceChildren(form);
  input.focus();
}

function start(): void {
  const main = h("main", { id: "view" });
  const live = h("span", { class: "live", id: "live" });
  const nav = h("nav", {},
    h("strong", {}, "sandlot"),
    h("a", { href: "#/sandboxes" }, "Sandboxes"), h("a", { href: "#/tree" }, "Tree"),
    h("a", { href: "#/hosts" }, "Hosts"), live,
    h("button", { type: "button", id: "sign-out", onclick: () => { setKey(null); signIn(); } },
      "Sign out"));
  app.replaceChildren(nav,
    h("div", { id: "error", class: "banner error", role: "alert", hidden: true,
               onclick: clearError }),
    h("div", { id: "notice", class: "banner notice", hidden: true }), main);
  onChange(() => {
    live.textContent = store.live ? "● live" : "○ reconnecting";
    live.className = store.live ? "live on" : "live";
  });
  window.onhashchange = route;
  route();
  follow();
}

function route(): void {
  const main = document.getElementById("view");
  if (!main) return;
  leave?.();
  clearError();
  main.replaceChildren();
  const [, page, id] = location.hash.split("/");
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("current", a.getAttribute("href") === `#/${page}`);
  }
  if (page === "tree") leave = treeView(main);
  else if (page === "hosts") leave = hostsView(main);
  else if (page === "sandbox" && id) leave = sandboxView(main, decodeURIComponent(id));
  else leave = sandboxesView(main);
}

window.addEventListener("unhandledrejection", (ev) => {
  if (ev.reason instanceof ApiError && ev.reason.status === 401) {
    setKey(null);
    signIn(ev.reason.message);
  }
});

if (key()) start();
else signIn();
