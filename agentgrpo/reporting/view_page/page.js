"use strict";
// agentgrpo view: a run's episodes, step by step. DATA is embedded by the page's writer: a static
// page holds every step in DATA.step_data; a live page asks the server (api/step/N) and polls
// api/index to follow a run in progress.

const DATA = JSON.parse(document.getElementById("data").textContent);
const TOKENS = DATA.tokens; // token id -> its text; empty without a tokenizer (ids are shown)
const STEPS = new Map(Object.entries(DATA.step_data).map(([step, data]) => [Number(step), data]));
const POLL_MS = 3000;
let index = {
  steps: DATA.steps, metrics_key: DATA.metrics_key, tokenizer: DATA.tokenizer, metrics: DATA.metrics,
};

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "title" || name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function fmt(value) {
  if (typeof value !== "number") return value === null || value === undefined ? "–" : value;
  return Number.isInteger(value) ? String(value) : value.toFixed(3);
}

function counts(byName) {
  return Object.entries(byName).map(([name, n]) => `${name} ${n}`).join(", ");
}

function setStatus(text, failed = false) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = failed ? "error" : "";
}

async function loadStep(step) {
  const cached = STEPS.get(step);
  const entry = index.steps.find((s) => s.step === step);
  if (cached && (!DATA.live || (entry && entry.key === cached.key))) return cached;
  const response = await fetch(`api/step/${step}`);
  const data = await response.json();
  if (!response.ok) throw new Error(data.error);
  Object.assign(TOKENS, data.tokens);
  STEPS.set(step, data);
  return data;
}

// ---- filters

function filters() {
  return {
    min: parseFloat(document.getElementById("reward-min").value),
    max: parseFloat(document.getElementById("reward-max").value),
    finish: document.getElementById("finish").value,
    failedOnly: document.getElementById("failed-only").checked,
  };
}

function keep(episode, f) {
  const reward = typeof episode.reward === "number" ? episode.reward : NaN;
  if (!Number.isNaN(f.min) && !(reward >= f.min)) return false;
  if (!Number.isNaN(f.max) && !(reward <= f.max)) return false;
  if (f.finish && episode.finish !== f.finish) return false;
  return !f.failedOnly || Object.keys(episode.tool_errors).length > 0;
}

// ---- a pane: one step's summary, its episodes, and the episode opened

function makePane(id, pick) {
  const root = document.getElementById(id);
  const pane = { root, pick, step: null, open: null, shownKey: null };
  pane.select = el("select", { class: "step" });
  pane.body = el("div");
  pane.select.addEventListener("change", () => {
    pane.step = Number(pane.select.value);
    pane.open = null;
    showPane(pane);
  });
  root.append(el("label", {}, "step ", pane.select), pane.body);
  return pane;
}

function fillSteps(pane) {
  const steps = index.steps.map((s) => String(s.step));
  if ([...pane.select.options].map((o) => o.value).join() !== steps.join()) {
    pane.select.replaceChildren(...steps.map((s) => el("option", { value: s }, `step ${s}`)));
  }
  if (!steps.includes(String(pane.step))) pane.step = steps.length ? Number(pane.pick(steps)) : null;
  pane.select.value = String(pane.step);
}

async function showPane(pane) {
  const step = pane.step;
  if (step === null) {
    pane.body.replaceChildren(el("p", {}, "No episodes recorded yet (episodes/step-N.jsonl)."));
    return;
  }
  let data;
  try {
    data = await loadStep(step);
  } catch (error) {
    pane.body.replaceChildren(el("p", { class: "failed" }, `step ${step}: ${error.message}`));
    return;
  }
  if (pane.step !== step) return; // another step was picked meanwhile
  const f = filters();
  const shown = data.episodes.map((e, i) => [e, i]).filter(([e]) => keep(e, f));
  const note = data.note ? el("p", { class: "failed" }, data.note) : null; // lines skipped
  pane.body.replaceChildren(
    ...[note, summary(data.summary), episodeTable(pane, data, shown), detail(pane, data)].filter(Boolean),
  );
  pane.shownKey = data.key;
}

function summary(s) {
  const parts = [
    `${s.episodes} episodes`,
    `reward ${fmt(s.reward)}`,
    ...Object.entries(s.rewards).map(([name, value]) => `${name} ${fmt(value)}`),
    `finish: ${counts(s.finish)}`,
    `tool calls ${s.tool_calls}`,
    `failed ${s.failed_calls}${s.failed_calls ? ` (${counts(s.tool_errors)})` : ""}`,
    `sampled tokens ${s.sampled_tokens} of ${s.completion_tokens}`,
  ];
  return el("p", { class: "summary" }, ...parts.map((part) => el("span", {}, part)));
}

function label(e) {
  const seat = e.seat === null || e.seat === undefined ? "" : ` (seat ${e.seat})`;
  return `${e.process ? `${e.process}:` : ""}${e.group}.${e.index}${seat}`;
}

function num(value) {
  return el("td", { class: "num" }, fmt(value));
}

function episodeTable(pane, data, shown) {
  if (!shown.length) return el("p", {}, "No episode of this step passes the filters.");
  const functions = Object.keys(data.summary.rewards);
  const heads = ["episode", "reward", "advantage", ...functions, "finish", "turns", "tool calls",
    "failed calls", "tokens (sampled)"];
  const rows = shown.map(([e, i]) => {
    const tokens = e.rows.reduce((n, r) => n + r.completion_ids.length, 0);
    const sampled = e.rows.reduce((n, r) => n + r.loss_mask.filter((m) => m === 1).length, 0);
    const row = el("tr", { class: i === pane.open ? "open" : "", "data-episode": i },
      el("td", {}, label(e)), num(e.reward), num(e.advantage),
      ...functions.map((name) => num(e.rewards[name])),
      el("td", {}, e.finish), num(e.turns), num(e.tool_calls),
      el("td", { class: "failed" }, counts(e.tool_errors)), el("td", {}, `${tokens} (${sampled})`));
    row.addEventListener("click", () => {
      pane.open = i;
      showPane(pane);
    });
    return row;
  });
  return el("table", { class: "episodes" },
    el("thead", {}, el("tr", {}, ...heads.map((h) => el("th", {}, h)))), el("tbody", {}, ...rows));
}

// ---- an episode: its scores, tool calls, and every token coloured by its loss mask

function detail(pane, data) {
  const e = data.episodes[pane.open];
  if (!e) return el("div", { class: "detail" }, el("p", {}, "Click an episode to open it."));
  const rewards = Object.entries(e.rewards).map(([name, value]) => `${name} ${fmt(value)}`);
  return el("div", { class: "detail" },
    el("h3", {}, `step ${data.step}, episode ${label(e)}`),
    el("p", {}, `reward ${fmt(e.reward)} (${rewards.join(", ")}) · advantage ${fmt(e.advantage)}` +
      ` · finish ${e.finish} · ${e.turns} turns` +
      (e.responses ? ` · ${e.responses} replies from the environment` : "") +
      ` · played with the weights of ${steps(e)}`),
    el("p", {}, "task: ", el("code", {}, e.task)),
    e.images.length ? el("p", { class: "images" }, "pictures the model saw: ",
      ...e.images.map((src, i) => el("img", { src, alt: `picture ${i + 1}`, title: `picture ${i + 1}` }))) : null,
    e.error ? el("p", { class: "failed" }, `error: ${e.error}`) : null,
    callTable(e.calls),
    el("p", { class: "legend" }, el("span", { class: "tok p" }, "prompt (mask 0)"),
      el("span", { class: "tok m0" }, "tool, environment, template (mask 0)"),
      el("span", { class: "tok m1" }, "sampled by the policy, trained on (mask 1)"),
      "hover a token for its id and sampler logprob"),
    ...e.rows.map((row, r) => tokenRow(row, r, e.rows.length, e.row_kinds[r])));
}

function callTable(calls) {
  if (!calls.length) return el("p", {}, "No tool calls.");
  const rows = calls.map((c) => el("tr", { class: c.error ? "failed" : "" },
    el("td", {}, c.name ?? "(unparsed)"), el("td", {}, c.arguments), el("td", {}, c.result),
    el("td", {}, c.error ?? "")));
  return el("table", { class: "calls" },
    el("thead", {}, el("tr", {}, ...["tool call", "arguments", "result", "error"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows));
}

function tokenRow(row, r, count, kind) {
  const sampled = row.loss_mask.filter((m) => m === 1).length;
  const named = r > 0 || kind !== "task";  // a fork, a compaction, or a seat's side of a game
  const which = count > 1 || named ? `row ${r + 1} of ${count}${named ? ` (${kind})` : ""}: ` : "";
  const prompt = row.prompt_ids.map((id) => token(id, "p", `prompt · id ${id}`));
  const completion = row.completion_ids.map((id, i) => row.loss_mask[i] === 1
    ? token(id, "m1", `sampled · logprob ${logprob(row.logprobs[i])}${version(row, i)} · id ${id}`)
    : token(id, "m0", `tool / environment / template · id ${id}`));
  return el("div", { class: "row" },
    el("h4", {}, `${which}${row.completion_ids.length} completion tokens, ${sampled} sampled`),
    el("details", {}, el("summary", {}, `prompt: ${row.prompt_ids.length} tokens`),
      el("div", { class: "tokens prompt" }, ...prompt)),
    el("div", { class: "tokens completion", "data-row": r }, ...completion));
}

// The steps whose weights drew the episode's tokens: one, or a range when it spans a weight update.
function steps(e) {
  const versions = e.rows.flatMap((row) => (row.versions || []).filter((v) => v >= 0));
  if (!versions.length) return `step ${e.policy_version}`;
  const [low, high] = [Math.min(...versions), Math.max(...versions)];
  return low === high ? `step ${low}` : `steps ${low} to ${high}`;
}

function version(row, i) {
  return row.versions ? ` · weights of step ${row.versions[i]}` : "";
}

function logprob(value) {
  return typeof value === "number" ? value.toPrecision(4) : value;
}

function token(id, kind, title) {
  const text = TOKENS[id];
  if (text === undefined) return el("span", { class: `tok ${kind} id`, title }, `[${id}]`);
  return el("span", { class: `tok ${kind}`, title }, text.replace(/\n/g, "↵\n"));
}

// ---- the page

const panes = [
  makePane("pane-a", (steps) => steps[steps.length - 1]),
  makePane("pane-b", (steps) => steps[0]),
];

function comparing() {
  return document.getElementById("compare").checked;
}

function showPanes() {
  for (const pane of comparing() ? panes : panes.slice(0, 1)) showPane(pane);
}

function refresh(tokensChanged) {
  for (const pane of comparing() ? panes : panes.slice(0, 1)) {
    fillSteps(pane);
    const entry = index.steps.find((s) => s.step === pane.step);
    if (tokensChanged || !entry || entry.key !== pane.shownKey) showPane(pane);
  }
}

function showNotes() {
  document.getElementById("tokenizer").textContent = index.tokenizer;
  document.getElementById("metrics").textContent = index.metrics; // "" when all is well
}

async function poll() {
  try {
    const response = await fetch(`api/index?metrics=${encodeURIComponent(index.metrics_key ?? "")}`);
    const fresh = await response.json();
    if (!response.ok) throw new Error(fresh.error);
    for (const [name, svg] of Object.entries(fresh.charts ?? {})) {
      document.getElementById(`chart-${name}`).innerHTML = svg;
    }
    const tokensChanged = fresh.tokenizer !== index.tokenizer;
    if (tokensChanged) STEPS.clear(); // refetched with their token texts
    index = fresh;
    showNotes();
    refresh(tokensChanged);
    const time = new Date().toLocaleTimeString();
    setStatus(`following the run: ${index.steps.length} steps recorded (checked ${time})`);
  } catch (error) {
    setStatus(`cannot read the run from the viewer (${error.message}); retrying`, true);
  }
  setTimeout(poll, POLL_MS);
}

function start() {
  const finish = document.getElementById("finish");
  finish.append(...DATA.finishes.map((name) => el("option", { value: name }, name)));
  for (const id of ["reward-min", "reward-max", "finish", "failed-only"]) {
    document.getElementById(id).addEventListener("input", showPanes);
  }
  document.getElementById("compare").addEventListener("change", () => {
    panes[1].root.hidden = !comparing();
    document.getElementById("panes").classList.toggle("compare", comparing());
    refresh(false);
  });
  showNotes();
  setStatus(DATA.live ? "following the run" : "a static page of the run as it was written; " +
    "`agentgrpo view RUN_DIR` follows a run in progress");
  refresh(false);
  if (DATA.live) setTimeout(poll, POLL_MS);
}

start();
