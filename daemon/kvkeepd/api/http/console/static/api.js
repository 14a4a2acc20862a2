// The daemon's routes, called with the token (kept in this module's memory only: it is never
// written to storage, a cookie or the address).

let token = "";

export function setToken(value) {
  token = value.trim();
}

function headers(json) {
  const h = {};
  if (token) h.authorization = `Bearer ${token}`;
  if (json) h["content-type"] = "application/json";
  return h;
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function check(response) {
  if (response.ok) return response;
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error.message;
  } catch {
    // not a JSON error body: the status says it
  }
  throw new ApiError(response.status, message);
}

export async function get(path) {
  return (await check(await fetch(path, { headers: headers(false) }))).json();
}

export async function send(method, path, body) {
  const init = { method, headers: headers(body !== undefined) };
  if (body !== undefined) init.body = JSON.stringify(body);
  return (await check(await fetch(path, init))).json();
}

export async function download(path, name) {
  const blob = await (await check(await fetch(path, { headers: headers(false) }))).blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  URL.revokeObjectURL(link.href);
}

// A chat turn on a session through /v1/chat/completions, streamed: `onChunk` gets each
// server-sent event's JSON.
export async function chat(body, onChunk) {
  const response = await check(
    await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body) }),
  );
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value;
    let end;
    while ((end = pending.indexOf("\n\n")) >= 0) {
      const event = pending.slice(0, end);
      pending = pending.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error.message);
        onChunk(chunk);
      }
    }
  }
}
