// Building the page: every text, model output above all, goes in as textContent, never as
// markup, so a reply or a label holding "<script>" is shown, not run.

export const $ = (selector) => document.querySelector(selector);

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  for (const child of children) node.append(typeof child === "string" ? document.createTextNode(child) : child);
  return node;
}

const SVG = "http://www.w3.org/2000/svg";

export function svg(tag, attributes = {}, text = "") {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text) node.textContent = text;
  return node;
}

export function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function when(seconds) {
  if (!seconds) return "never";
  const ago = Date.now() / 1000 - seconds;
  const span = Math.abs(ago);
  const text = span < 90 ? `${Math.round(span)} s` : span < 5400 ? `${Math.round(span / 60)} min` : `${Math.round(span / 3600)} h`;
  return ago >= 0 ? `${text} ago` : `in ${text}`;
}

export function short(id) {
  return id.length > 14 ? `${id.slice(0, 10)}…` : id;
}
