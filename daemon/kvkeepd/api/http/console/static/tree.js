// A session's tree drawn as SVG: the session's line of checkpoints left to right (oldest
// first), its state now at the end, and its forks hanging under the node they came from.
// Stored responses draw the same way, each under the response it continues.

import { short, svg } from "./dom.js";

const STEP = 150;
const ROW = 70;
const R = 16;

// nodes: [{id, kind, label, tokens, detail, parent, branch}] in drawing order, parents first.
// A node follows its parent to the right on the parent's row, or on a row of its own below
// (`branch`: a fork, a second continuation); a node without a parent starts a row.
export function draw(target, nodes, selected, onPick) {
  target.replaceChildren();
  const place = new Map();
  let rows = 0;
  let columns = 1;
  for (const node of nodes) {
    const parent = node.parent ? place.get(node.parent) : undefined;
    const spot = !parent ? { x: 0, y: rows++ } : { x: parent.x + 1, y: node.branch ? rows++ : parent.y };
    place.set(node.id, spot);
    columns = Math.max(columns, spot.x + 1);
  }
  const height = Math.max(rows, 1) * ROW + 20;
  target.setAttribute("height", String(height));
  target.setAttribute("viewBox", `0 0 ${columns * STEP + 40} ${height}`);
  const at = (p) => ({ cx: 50 + p.x * STEP, cy: 30 + p.y * ROW });
  for (const node of nodes) {
    const from = node.parent ? place.get(node.parent) : undefined;
    if (!from) continue;
    const here = at(place.get(node.id));
    const there = at(from);
    target.append(svg("path", { d: `M${there.cx},${there.cy} V${here.cy} H${here.cx}`, class: "edge" }));
  }
  for (const node of nodes) {
    const { cx, cy } = at(place.get(node.id));
    const kind = `node ${node.kind}${node.id === selected ? " selected" : ""}`;
    const group = svg("g", { class: kind, tabindex: 0, "data-id": node.id, "data-kind": node.kind });
    group.append(svg("circle", { cx, cy, r: R }));
    group.append(svg("text", { x: cx, y: cy + R + 14, "text-anchor": "middle", class: "label" }, node.label || short(node.id)));
    const tokens = node.tokens === undefined ? "" : String(node.tokens);
    group.append(svg("text", { x: cx, y: cy + 4, "text-anchor": "middle", class: "tokens" }, tokens));
    group.append(svg("title", {}, `${node.id}\n${node.detail}`));
    group.addEventListener("click", () => onPick(node));
    group.addEventListener("keydown", (event) => {
      if (event.key === "Enter") onPick(node);
    });
    target.append(group);
  }
}

// A spark line of the last values of a counter, for the daemon pane.
export function spark(values, width = 160, height = 36) {
  const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "spark" });
  if (values.length < 2) return chart;
  const low = Math.min(...values);
  const high = Math.max(...values);
  const span = high - low || 1;
  const points = values.map((v, i) => `${(i / (values.length - 1)) * width},${height - 2 - ((v - low) / span) * (height - 4)}`);
  chart.append(svg("polyline", { points: points.join(" ") }));
  return chart;
}
