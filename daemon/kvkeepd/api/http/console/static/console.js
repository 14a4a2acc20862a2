// The console's page: the session list (polled), the selected session's tree and the
// conversation up to a node, the actions on nodes, a chat pane whose messages each fork a
// session through them ("branch here"), and the daemon at a glance.
// Plain ES modules over the daemon's JSON routes; see the package's docstring for why.

import * as api from "./api.js";
import { $, bytes, el, short, when } from "./dom.js";
import { draw, spark } from "./tree.js";

const POLL_MS = 3000;
const HISTORY = 40;

const state = {
  sessions: [],
  session: null, // the selected session's id
  tree: null,
  node: null,
  responses: false, // the stored responses' tree is shown
  readOnly: false,
  history: { tokens_generated: [], tokens_evaluated: [], slots_in_use: [], ram_used_bytes: [] },
  polling: null,
};

function status(text, bad = false) {
  const line = $("#status");
  line.textContent = text;
  line.className = bad ? "bad" : "";
}

async function attempt(what, fn) {
  try {
    return await fn();
  } catch (error) {
    status(`${what}: ${error.message}`, true);
    return undefined;
  }
}

// ---- sessions --------------------------------------------------------------------------------

async function refreshSessions() {
  const listed = await attempt("sessions", () => api.get("/console/api/sessions"));
  if (!listed) return;
  state.sessions = listed.data;
  renderSessions();
}

function renderSessions() {
  const words = $("#filter").value.trim().toLowerCase().split(/\s+/).filter(Boolean);
  const key = $("#sort").value;
  const shown = state.sessions
    .filter((s) => {
      const text = `${s.session_id} ${s.location} ${s.tier} ${s.persistent ? "persistent" : "ephemeral"} ${s.holder}`;
      return words.every((w) => text.toLowerCase().includes(w));
    })
    .sort((a, b) => (key === "tier" ? byWhere(a, b) : b[key] - a[key]));
  const rows = shown.map((s) => {
    const row = el(
      "tr",
      { "data-session": s.session_id, tabindex: 0 },
      el("td", { class: "id" }, short(s.session_id)),
      el("td", {}, s.persistent ? "persistent" : "ephemeral"),
      el("td", { class: "num" }, String(s.n_tokens)),
      el("td", { class: "where" }, el("span", { class: `tier ${s.tier}`, title: s.tier }, s.location)),
      el("td", {}, s.holder || "here"),
      el("td", {}, when(s.last_used_at)),
      el("td", {}, when(s.expires_at)),
    );
    if (s.session_id === state.session) row.classList.add("selected");
    row.addEventListener("click", () => openSession(s.session_id));
    return row;
  });
  $("#sessions tbody").replaceChildren(...rows);
}

// Hot first (slots), then warm (dock, RAM), then cold (stored, history only); by location within.
const HEAT = { hot: 0, warm: 1, cold: 2 };
function byWhere(a, b) {
  return HEAT[a.tier] - HEAT[b.tier] || a.location.localeCompare(b.location, undefined, { numeric: true });
}

// ---- a session's tree ------------------------------------------------------------------------

async function openSession(sessionId) {
  state.session = sessionId;
  state.responses = false;
  state.node = null;
  $("#chat-session").textContent = short(sessionId);
  $("#chat").replaceChildren();
  renderSessions();
  await refreshTree();
  const now = state.tree && treeNodes(state.tree).find((n) => n.kind === "now");
  if (now) await pick(now);
}

async function refreshTree() {
  if (state.responses) return showResponses();
  if (!state.session) return;
  const tree = await attempt("tree", () => api.get(`/console/api/sessions/${state.session}`));
  if (!tree) return;
  state.tree = tree;
  $("#tree-title").textContent = `Tree of ${short(state.session)}`;
  draw($("#tree"), treeNodes(tree), state.node?.id, pick);
}

function treeNodes(tree) {
  const s = tree.session;
  const nodes = [];
  let parent = null;
  if (s.forked_from) {
    nodes.push({ id: s.forked_from, kind: "origin", label: "forked from", detail: s.forked_from, parent: null });
    parent = s.forked_from;
  }
  for (const c of tree.checkpoints) {
    const detail = `${c.n_tokens} tokens, ${bytes(c.bytes_written)} written (${bytes(c.bytes_referenced)} referenced), in the ${c.store} store (${c.location})`;
    nodes.push({ id: c.checkpoint_id, kind: "checkpoint", label: c.label, tokens: c.n_tokens, detail, parent, data: c });
    parent = c.checkpoint_id;
  }
  const detail = `${s.n_tokens} tokens, in ${s.location} (${s.tier}), ${s.persistent ? "persistent" : "ephemeral"}`;
  nodes.push({ id: s.session_id, kind: "now", label: "now", tokens: s.n_tokens, detail, parent, data: s });
  for (const f of tree.forks) {
    const from = f.forked_from === s.session_id ? s.session_id : f.forked_from;
    const text = `fork: ${f.n_tokens} tokens, in ${f.location} (${f.tier})`;
    nodes.push({ id: f.session_id, kind: "fork", label: short(f.session_id), tokens: f.n_tokens, detail: text, parent: from, branch: true, data: f });
  }
  return nodes;
}

async function showResponses() {
  state.responses = true;
  state.session = null;
  renderSessions();
  const listed = await attempt("stored responses", () => api.get("/console/api/responses"));
  if (!listed) return;
  $("#tree-title").textContent = "Stored responses";
  const known = new Set();
  const continued = new Set();
  const nodes = listed.data.map((r) => {
    const parent = known.has(r.previous_response_id) ? r.previous_response_id : null;
    const branch = parent !== null && continued.has(parent);
    if (parent) continued.add(parent);
    known.add(r.response_id);
    const detail = `${r.n_tokens} tokens, ${bytes(r.bytes_written)} written, in the ${r.store} store (${r.location}), expires ${when(r.expires_at)}`;
    return { id: r.response_id, kind: "response", label: short(r.response_id), tokens: r.n_tokens, detail, parent, branch, data: r };
  });
  draw($("#tree"), nodes, state.node?.id, pick);
}

async function pick(node) {
  if (node.kind === "fork" || (node.kind === "origin" && node.id.startsWith("s_"))) {
    return openSession(node.id);
  }
  state.node = node;
  $("#tree").querySelectorAll(".node").forEach((g) => g.classList.toggle("selected", g.dataset.id === node.id));
  $("#node-facts").replaceChildren(el("strong", {}, node.label || node.id), ` ${node.id}: ${node.detail}`);
  renderActions(node);
  const messages =
    node.kind === "now"
      ? state.tree.session.messages
      : (await attempt("conversation", () => api.get(`/console/api/checkpoints/${node.id}/messages`)))?.data;
  const source = node.kind === "now" ? { session_id: node.id } : { checkpoint_id: node.id };
  renderConversation($("#conversation"), messages ?? [], source);
}

function renderConversation(list, messages, source) {
  list.replaceChildren(...messages.map((m, i) => messageItem(m, { ...source, through_message: i })));
}

// A message, with "branch here" where `branch` says what to fork and through which message.
function messageItem(m, branch) {
  const item = el("li", { class: `message ${m.role}` }, el("span", { class: "role" }, m.role));
  if (branch) item.append(branchButton(branch));
  item.append(el("span", { class: "content" }, m.content));
  for (const call of m.tool_calls ?? []) {
    item.append(el("code", { class: "call" }, `${call.name}(${call.arguments})`));
  }
  if (m.tool_call_id) item.append(el("span", { class: "result-of" }, `result of ${m.tool_call_id}`));
  return item;
}

function branchButton(branch) {
  const b = button("branch here", () => fork(branch), "Fork a new session holding the conversation up to this message?");
  b.classList.add("branch");
  return b;
}

// ---- actions ---------------------------------------------------------------------------------

function button(text, fn, question) {
  const b = el("button", { type: "button", "data-acts": "" }, text);
  b.disabled = state.readOnly;
  b.addEventListener("click", async () => {
    if (question && !window.confirm(question)) return;
    await attempt(text, fn);
    await refreshSessions();
    await refreshTree();
  });
  return b;
}

function renderActions(node) {
  const actions = [];
  if (node.kind === "checkpoint") {
    const sessionId = state.session;
    actions.push(
      button("Restore", async () => {
        const row = await api.send("POST", `/console/api/sessions/${sessionId}/restore`, { checkpoint_id: node.id });
        status(`restored to ${node.label || node.id}: ${row.n_tokens} tokens${row.reprefilled ? " (evaluated again)" : ""}`);
      }, `Put ${short(sessionId)} back to checkpoint ${node.label || node.id}? Turns after it are dropped.`),
      button("Fork", () => fork({ checkpoint_id: node.id }), `Fork a new session from ${node.label || node.id}?`),
      el("button", { type: "button", class: "export" }, "Export"),
      button("Delete", async () => {
        await api.send("DELETE", `/console/api/checkpoints/${node.id}`);
        state.node = null;
      }, `Delete checkpoint ${node.label || node.id}?`),
    );
    const exporting = actions[2];
    exporting.addEventListener("click", () => attempt("export", () => api.download(`/console/api/checkpoints/${node.id}/export`, `${node.id}.kvkeep`)));
  } else if (node.kind === "now") {
    const label = el("input", { id: "checkpoint-label", placeholder: "label", "aria-label": "checkpoint label" });
    label.disabled = state.readOnly;
    actions.push(
      label,
      button("Checkpoint", async () => {
        const c = await api.send("POST", `/console/api/sessions/${node.id}/checkpoints`, { label: label.value });
        status(`checkpoint ${c.checkpoint_id}: ${c.n_tokens} tokens`);
      }),
      button("Fork", () => fork({ session_id: node.id }), `Fork a new session from ${short(node.id)} as it is now?`),
      button("Close", async () => {
        await api.send("DELETE", `/console/api/sessions/${node.id}`);
        state.session = null;
        state.tree = null;
        $("#tree").replaceChildren();
        $("#conversation").replaceChildren();
      }, `Close session ${short(node.id)} and delete its state?`),
    );
  } else if (node.kind === "response") {
    actions.push(
      button("Fork", () => fork({ checkpoint_id: node.id }), `Fork a new session from response ${short(node.id)}?`),
      button("Delete", () => api.send("DELETE", `/v1/responses/${node.id}`), `Delete response ${short(node.id)}?`),
    );
  }
  $("#node-actions").replaceChildren(...actions);
}

async function fork(from) {
  const made = await api.send("POST", "/console/api/forks", from);
  status(`forked ${made.session_id}: ${made.n_tokens} tokens`);
  await openSession(made.session_id);
}

// ---- chat ------------------------------------------------------------------------------------

async function sendMessage(event) {
  event.preventDefault();
  const text = $("#message").value;
  if (!state.session || !text.trim()) return;
  const log = $("#chat");
  const sessionId = state.session;
  const asked = messageItem({ role: "user", content: text });
  log.append(asked);
  const reply = el("span", { class: "content" });
  const calls = el("span", { class: "calls" });
  const usage = el("span", { class: "usage" });
  const answer = el("li", { class: "message assistant streaming" }, el("span", { class: "role" }, "assistant"), reply, calls, usage);
  log.append(answer);
  const bar = $("#prompt-progress");
  const body = {
    model: "kvkeep",
    session_id: state.session,
    messages: [{ role: "user", content: text }],
    stream: true,
    stream_options: { include_usage: true },
    return_progress: true,
    max_tokens: Number($("#max-tokens").value) || 64,
    temperature: Number($("#temperature").value),
  };
  $("#send").disabled = true;
  $("#message").value = "";
  await attempt("chat", () =>
    api.chat(body, (chunk) => {
      const p = chunk.prompt_progress;
      if (p) {
        bar.hidden = false;
        bar.max = p.total || 1;
        bar.value = p.processed;
      }
      for (const choice of chunk.choices ?? []) {
        const delta = choice.delta ?? {};
        if (delta.content) reply.textContent += delta.content;
        for (const call of delta.tool_calls ?? []) {
          calls.textContent += call.function?.name ? ` call ${call.function.name}(` : "";
          calls.textContent += call.function?.arguments ?? "";
        }
      }
      if (chunk.usage) {
        const cached = chunk.usage.prompt_tokens_details?.cached_tokens ?? 0;
        usage.textContent = `prompt ${chunk.usage.prompt_tokens} (cached ${cached}), generated ${chunk.usage.completion_tokens}`;
      }
    }),
  );
  bar.hidden = true;
  answer.classList.remove("streaming");
  $("#send").disabled = false;
  await refreshTree();
  await refreshSessions();
  // The turn's message and reply are the session's last two: each may start a branch.
  const held = state.tree?.session.session_id === sessionId ? state.tree.session.messages : [];
  if (held.at(-1)?.role === "assistant" && held.at(-2)?.content === text) {
    asked.firstChild.after(branchButton({ session_id: sessionId, through_message: held.length - 2 }));
    answer.firstChild.after(branchButton({ session_id: sessionId, through_message: held.length - 1 }));
  }
}

// ---- the daemon ------------------------------------------------------------------------------

async function refreshInfo() {
  const info = await attempt("info", () => api.get("/console/api/info"));
  if (!info) return;
  state.readOnly = info.console === "read-only";
  document.body.classList.toggle("read-only", state.readOnly);
  document.querySelectorAll("[data-acts]").forEach((b) => (b.disabled = state.readOnly));
  $("#chat-form").hidden = state.readOnly;
  const m = info.model;
  const b = info.budgets;
  const q = info.tenant.quota;
  const facts = [
    ["model", `${m.id} (${m.architecture}, ${m.description})`],
    ["mode", `${m.mode}${m.flash_attention ? ", flash attention" : ""}, KV ${m.kv_type}, context ${m.ctx_per_session} per session`],
    ["slots", `${info.slots_in_use} of ${info.slots} in use`],
    ["RAM", `${bytes(b.ram_used_bytes)} of ${bytes(b.ram_bytes)}`],
    ["disk", `${bytes(b.disk_used_bytes)} of ${b.disk_bytes ? bytes(b.disk_bytes) : "no budget"}`],
    ["tenant", `${info.tenant.name || "anonymous"}: ${info.tenant.sessions.total} sessions (${info.tenant.sessions.hot} hot, ${info.tenant.sessions.warm} warm, ${info.tenant.sessions.cold} cold)`],
    ["quotas", `sessions ${q.sessions || "∞"}, parked ${q.parked_bytes ? bytes(q.parked_bytes) : "∞"}, stored ${q.stored_bytes ? bytes(q.stored_bytes) : "∞"}`],
    ["console", info.console],
  ];
  $("#glance").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const seen = {
    tokens_generated: info.counters.tokens_generated,
    tokens_evaluated: info.counters.tokens_evaluated,
    slots_in_use: info.slots_in_use,
    ram_used_bytes: b.ram_used_bytes,
  };
  const charts = [];
  for (const [name, value] of Object.entries(seen)) {
    const line = state.history[name];
    line.push(value);
    if (line.length > HISTORY) line.shift();
    charts.push(el("figure", {}, spark(line), el("figcaption", {}, `${name.replaceAll("_", " ")}: ${value}`)));
  }
  $("#charts").replaceChildren(...charts);
}

// ---- wiring ----------------------------------------------------------------------------------

async function connect(event) {
  event?.preventDefault();
  api.setToken($("#token").value);
  status("connecting…");
  await refreshInfo();
  await refreshSessions();
  if (!$("#status").classList.contains("bad")) status("connected");
  clearInterval(state.polling);
  state.polling = setInterval(async () => {
    await refreshSessions();
    await refreshInfo();
  }, POLL_MS);
}

async function newSession() {
  const made = await attempt("new session", () => api.send("POST", "/console/api/sessions", {}));
  if (!made) return;
  await refreshSessions();
  await openSession(made.session_id);
}

$("#login").addEventListener("submit", connect);
$("#filter").addEventListener("input", renderSessions);
$("#sort").addEventListener("change", renderSessions);
$("#new-session").addEventListener("click", newSession);
$("#show-responses").addEventListener("click", () => {
  state.node = null;
  showResponses();
});
$("#chat-form").addEventListener("submit", sendMessage);
connect();
