// The search page: plain JS against the public API; no build step.
"use strict";

const state = { info: null, examples: {}, query: {}, searches: 0, maxK: 100 };
const LABEL_CHARS = 60;  // what a long query text is shown as: its start, never all of it
const RECORD_MS = 2000;  // long enough to start speaking after the click
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick" || k === "onchange" || k === "oninput") node[k] = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

async function toDataURI(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// 16-bit PCM mono WAV from float samples: the service decodes WAV only.
function wavBlob(samples, rate) {
  const buf = new ArrayBuffer(44 + samples.length * 2);
  const v = new DataView(buf);
  const str = (o, s) => [...s].forEach((c, i) => v.setUint8(o + i, c.charCodeAt(0)));
  str(0, "RIFF"); v.setUint32(4, 36 + samples.length * 2, true); str(8, "WAVE");
  str(12, "fmt "); v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, rate, true); v.setUint32(28, rate * 2, true); v.setUint16(32, 2, true);
  v.setUint16(34, 16, true); str(36, "data"); v.setUint32(40, samples.length * 2, true);
  samples.forEach((s, i) => v.setInt16(44 + i * 2, Math.max(-1, Math.min(1, s)) * 32767, true));
  return new Blob([buf], { type: "audio/wav" });
}

function short(text) {
  return text.length > LABEL_CHARS ? `${text.slice(0, LABEL_CHARS - 1)}…` : text;
}

function setValue(name, value, label) {
  if (value === null) delete state.query[name]; else state.query[name] = value;
  const box = document.getElementById(`mod-${name}`);
  box.classList.toggle("active", value !== null);
  box.querySelector(".chosen").textContent = value === null ? "not in the query" : label;
  box.querySelectorAll(".selected").forEach((n) => n.classList.remove("selected"));
}

// The demo's media take the read key when the server asks for one, and <img>/<audio> cannot
// send it: with a key, the page fetches them itself and shows them from a blob URL.
function withMedia(node, url) {
  if (sessionStorage.getItem("hclip-key") === null) { node.src = url; return Promise.resolve(node); }
  return api(url).then((r) => (r.ok ? r.blob() : null)).then((blob) => {
    if (blob) node.src = URL.createObjectURL(blob);
    return node;
  });
}

async function pickURL(name, url, label, node) {
  const blob = await (await api(url)).blob();
  setValue(name, await toDataURI(blob), label);
  node.classList.add("selected");
}

function imageControls(name) {
  const ex = el("div", { class: "examples" });
  for (const item of state.examples.image || []) {
    const img = el("img", { alt: `example ${item.label}`, title: item.label, "data-example": "image" });
    withMedia(img, item.url);
    img.onclick = () => pickURL(name, item.url, `example image (${item.label})`, img);
    ex.append(el("figure", {}, img, el("figcaption", {}, item.label)));
  }
  const file = el("input", { type: "file", accept: "image/*" });
  file.onchange = async () => file.files[0] &&
    setValue(name, await toDataURI(file.files[0]), `uploaded ${file.files[0].name}`);
  return [ex, el("label", {}, "upload ", file)];
}

function audioControls(name) {
  // One row of examples per voice, labelled with it: the rows say the same words.
  const rows = new Map();
  for (const item of state.examples.audio || []) {
    const voice = item.voice || "";
    if (!rows.has(voice)) {
      rows.set(voice, el("div", { class: "examples", "data-voice": voice },
        el("span", { class: "voice" }, voice ? `voice ${voice}:` : "")));
    }
    const spoken = voice ? `"${item.label}" in voice ${voice}` : `"${item.label}"`;
    const b = el("button", { type: "button", "data-example": "audio", title: spoken }, item.label);
    b.onclick = () => {
      withMedia(new Audio(), item.url).then((a) => a.play()).catch(() => {});
      pickURL(name, item.url, `clip ${spoken}`, b);
    };
    rows.get(voice).append(b);
  }
  const ex = el("div", {}, ...rows.values());
  const file = el("input", { type: "file", accept: "audio/wav,.wav" });
  file.onchange = async () => file.files[0] &&
    setValue(name, await toDataURI(file.files[0]), `uploaded ${file.files[0].name}`);
  const rec = el("button", { type: "button", "data-action": "record" }, "record");
  rec.onclick = () => record(name, rec).catch((err) => {
    rec.textContent = "record";
    showError(`recording failed: ${err.message || err}`);
  });
  return [ex, el("label", {}, "upload WAV ", file), " ", rec];
}

// Where speech starts: the first 10 ms frame whose RMS passes a tenth of the loudest frame's,
// less a 30 ms margin. The model reads a fixed window from the start of a clip (the training
// clips start within a few ms of the word), so the silence before the user speaks must go.
function speechStart(samples, rate) {
  const frame = Math.max(1, Math.round(rate / 100));
  const rms = [];
  for (let i = 0; i + frame <= samples.length; i += frame) {
    let sum = 0;
    for (let j = i; j < i + frame; j++) sum += samples[j] * samples[j];
    rms.push(Math.sqrt(sum / frame));
  }
  const loudest = Math.max(0, ...rms);
  if (loudest === 0) return 0;
  const first = rms.findIndex((r) => r >= loudest / 10);
  return Math.max(0, first * frame - Math.round(0.03 * rate));
}

function recordFor(stream, ms) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    const recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (e) => chunks.push(e.data);
    recorder.onerror = (e) => reject(e.error || new Error("the recorder failed"));
    recorder.onstop = () => resolve(new Blob(chunks, { type: recorder.mimeType }));
    recorder.start();
    setTimeout(() => recorder.stop(), ms);
  });
}

async function record(name, button) {
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    throw new Error("this browser cannot record here (it needs https or localhost and a microphone)");
  }
  showError("");
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  button.textContent = `recording… (${RECORD_MS / 1000} s)`;
  let blob;
  try {
    blob = await recordFor(stream, RECORD_MS);
  } finally {
    stream.getTracks().forEach((t) => t.stop());
  }
  const ctx = new AudioContext();
  const audio = await ctx.decodeAudioData(await blob.arrayBuffer());
  ctx.close();
  const samples = audio.getChannelData(0);
  const speech = samples.subarray(speechStart(samples, audio.sampleRate));
  const seconds = (speech.length / audio.sampleRate).toFixed(1);
  setValue(name, await toDataURI(wavBlob(speech, audio.sampleRate)), `your recording (${seconds} s)`);
  button.textContent = "record";
}

function textControls(name, kind) {
  const ex = el("div", { class: "examples" });
  for (const text of (kind === "text" && state.examples.text) || []) {
    const b = el("button", { type: "button", "data-example": "text" }, text);
    b.onclick = () => { input.value = text; setValue(name, text, `"${text}"`); b.classList.add("selected"); };
    ex.append(b);
  }
  const input = el(kind === "vector" ? "textarea" : "input",
                   { type: "text", placeholder: kind === "vector" ? "[0.1, 0.2, …]" : "type text" });
  input.oninput = () => {
    const raw = input.value.trim();
    if (!raw) { setValue(name, null); return; }
    if (kind === "vector") {
      try { setValue(name, JSON.parse(raw), "a vector"); } catch { setValue(name, null); }
    } else setValue(name, raw, `"${short(raw)}"`);
  };
  return [ex, input];
}

function buildQueryForm() {
  const holder = $("#modalities");
  for (const [name, kind] of Object.entries(state.inputs)) {
    const clear = el("button", { type: "button" }, "clear");
    const box = el("div", { class: "modality", id: `mod-${name}` },
      el("h3", {}, el("span", {}, `${name} `, el("small", {}, `(${kind})`)), clear),
      el("div", { class: "chosen" }, "not in the query"));
    clear.onclick = () => {  // empties the box's inputs too, so the next typing starts afresh
      box.querySelectorAll("input, textarea").forEach((i) => { i.value = ""; });
      setValue(name, null);
    };
    const controls = kind === "image" ? imageControls(name)
      : kind === "audio" ? audioControls(name) : textControls(name, kind);
    controls.forEach((c) => box.append(c));
    holder.append(box);
  }
}

function showError(message) {
  const e = $("#error");
  e.textContent = message;
  e.hidden = !message;
  if (message) clearResults();  // an error replaces the previous answer: nothing stale stays
}

function clearResults() {
  $("#results").replaceChildren();
  $("#result-meta").textContent = "";
}

// A record's modality as the page shows it, from the payload the demo stores beside it.
function shown(kind, p) {
  if (kind === "image" && p.image_url) {
    const img = el("img", { alt: "image" });
    withMedia(img, p.image_url);
    return img;
  }
  if (kind === "audio" && p.audio_url) {
    const audio = el("audio", { controls: "", preload: "metadata" });
    withMedia(audio, p.audio_url);
    return audio;
  }
  if (kind === "text" && p.text) return el("span", {}, `“${p.text}”`);
  return null;
}

// The demo's records carry their digits: the card says which the view retrieved, and whether
// the record satisfies the task the page states (so a right answer does not look wrong).
function digitsLine(digits, query) {
  const parts = Object.entries(digits).map(([k, v]) =>
    el("span", query.has(k) ? {} : { class: "retrieved" }, `${k} ${v}${query.has(k) ? "" : " (retrieved)"}`));
  const line = el("div", { class: "meta" });
  parts.forEach((part, i) => line.append(...(i ? [" · ", part] : [part])));
  const task = (state.examples.task || {}).dataset;
  const { image, audio, text } = digits;
  let why = null;
  if (task === "interaction") {
    const ok = (image + audio) % 10 === text;
    why = `${ok ? "✓" : "✗"} (${image} + ${audio}) mod 10 = ${(image + audio) % 10}${ok ? "" : `, not ${text}`}`;
  } else if (task === "shared") {
    why = image === audio && audio === text ? "✓ one digit" : "✗ not one digit";
  }
  if (why) line.append(el("div", { class: why.startsWith("✓") ? "why right" : "why wrong" }, why));
  return line;
}

// Where the answer's time went, from the response's Server-Timing header: "in 16.0 ms (encode
// image 12.1, audio 14.2; search 0.4)"; the total alone for a cached answer.
function timingOf(header) {
  const stages = [...(header || "").matchAll(/([\w-]+);dur=([\d.]+)(?:;desc="([^"]*)")?/g)]
    .map(([, metric, ms, desc]) => ({ metric, ms: Number(ms), name: (desc || "").split(" (")[0] }));
  const total = stages.find((s) => s.metric === "total");
  if (!total) return "";
  const of = (metric) => stages.filter((s) => s.metric === metric);
  const encodes = of("encode").map((s) => `${s.name} ${s.ms.toFixed(1)}`);
  const searches = of("search").map((s) => s.ms.toFixed(1));
  const parts = [];
  if (encodes.length) parts.push(`encode ${encodes.join(", ")}`);
  if (searches.length) parts.push(`search ${searches.join(", ")}`);
  return `, in ${total.ms.toFixed(1)} ms` + (parts.length ? ` (${parts.join("; ")})` : "");
}

function renderResults(body, timing = "") {
  const list = $("#results");
  list.replaceChildren();
  const modalities = state.inputs;
  const query = new Set(body.view.split("+"));
  const retrieved = Object.keys(modalities).filter((m) => !query.has(m));
  $("#result-meta").textContent = `view ${body.view}, retrieving ${retrieved.join(" and ")}, ` +
    `version ${body.index_version}${body.cached ? ", from the cache" : ""}${timing}`;
  for (const r of body.results) {
    const p = r.payload || {};
    const item = el("li", { class: "result" });
    // What the view retrieved leads the card; the record's other modalities follow, smaller.
    const lead = el("div", { class: "lead" });
    const rest = el("div", { class: "minor" });
    for (const [name, kind] of Object.entries(modalities)) {
      const node = shown(kind, p);
      if (node) (query.has(name) ? rest : lead).append(el("div", { "data-modality": name }, node));
    }
    item.append(el("div", {}, el("span", { class: "score" }, r.score.toFixed(3)), ` ${r.id}`),
                lead, rest);
    if (p.digits) item.append(digitsLine(p.digits, query));
    list.append(item);
  }
}

async function search() {
  showError("");
  const names = Object.keys(state.query);
  if (names.length === 0) { showError("choose at least one modality"); return; }
  // k is checked here as the server checks it, in the server's words, whatever was typed
  const raw = $("#k").value.trim();
  const k = Number(raw);
  if (raw === "" || !Number.isInteger(k) || k < 1 || k > state.maxK) {
    showError(`invalid_input: k: must be between 1 and ${state.maxK} (HCLIP_MAX_K), got ${raw || "nothing"}`);
    state.searches += 1;
    document.body.dataset.searches = String(state.searches);
    return;
  }
  $("#status").textContent = "searching…";
  try {
    const res = await api("/v1/search", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ query: state.query, k }),
    });
    const body = await res.json();
    if (!res.ok) { showError(`${body.error_type}: ${body.error}`); return; }
    showError("");
    renderResults(body, timingOf(res.headers.get("server-timing")));
  } catch (err) {
    showError(String(err));
  } finally {
    $("#status").textContent = "";
    state.searches += 1;
    document.body.dataset.searches = String(state.searches);  // answered: results or an error
  }
}

// The server's read key (HCLIP_API_KEYS), when it asks for one: kept for this tab only.
function api(url, opts = {}) {
  const key = sessionStorage.getItem("hclip-key");
  const headers = { ...(opts.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  return fetch(url, { ...opts, headers });
}

function askForKey(wrong) {
  const form = $("#key-form");
  form.hidden = false;
  $("#info").textContent = wrong ? "that key was refused: try another" : "this server needs an API key";
  form.onsubmit = (e) => {
    e.preventDefault();
    sessionStorage.setItem("hclip-key", $("#key").value.trim());
    form.hidden = true;
    main();
  };
}

async function main() {
  const res = await api("/v1/info");
  if (res.status === 401) { askForKey(sessionStorage.getItem("hclip-key") !== null); return; }
  if (!res.ok) { $("#info").textContent = "no index loaded yet: reload in a moment"; return; }
  state.info = await res.json();
  // what a query gives each modality (servers before `inputs`: the encoder kind)
  state.inputs = state.info.model.inputs || state.info.model.modalities;
  const ex = await api("/v1/demo/examples");
  if (ex.ok) state.examples = await ex.json();
  if (state.examples.task) $("#task").textContent = state.examples.task.line;
  // the server's own bound on k, from its contract (specialised to its settings)
  try {
    const spec = await (await fetch("/openapi.json")).json();
    const kSchema = spec.components.schemas.SearchRequest.properties.k.anyOf[0];
    if (Number.isInteger(kSchema.maximum)) state.maxK = kSchema.maximum;
  } catch { /* a server without the bound in its contract: the default stands */ }
  $("#k").max = String(state.maxK);
  const m = state.info.model;
  $("#info").textContent = `${m.head} model ${m.fingerprint}, d = ${m.d}; index ${state.info.index_version}, ` +
    `${state.info.counts.records} records`;
  buildQueryForm();
  $("#search").onclick = search;
  document.body.dataset.ready = "1";
}

main();
