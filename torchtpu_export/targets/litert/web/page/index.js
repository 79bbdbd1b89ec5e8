// The runner page: pick a served model, run it on random or given inputs, show outputs and timings.
// `window.tte` is the page's API for scripts (driver.mjs uses it in the browser tests).
import {ACCELERATORS, checkAccelerator, fromBase64, initLiteRt, loadModel, median, npyToInput, parseNpy,
        randomInputs, runModel, runtime, toBase64} from './litert_runner.js';

const $ = (id) => document.getElementById(id);
const loaded = new Map();  // accelerator + model url -> loadModel() result
let current = null;        // the model shown in the page
let given = {};            // input name -> {dtype, shape, data} from --inputs or picked files

/** A model compiled for an accelerator ('auto', 'webgpu', 'wasm'; default: the page's choice), cached. */
async function getModel(url, accelerator = null) {
  const acc = checkAccelerator(accelerator ?? runtime.accelerator);
  const key = `${acc} ${url}`;
  if (!loaded.has(key)) loaded.set(key, loadModel(url, acc));
  try {
    return await loaded.get(key);
  } catch (e) {
    loaded.delete(key);
    throw e;
  }
}

/** Where a loaded model runs, for the API: loadModel()'s accelerator report and the wasm threading. */
function acceleratorReport(m) {
  return {...m.accelerator, threads: m.threads};
}

function setStatus(text, error = false) {
  $('status').textContent = text;
  $('status').className = error ? 'error' : '';
}

function fmt(x) {
  return Number.isInteger(x) ? String(x) : x.toPrecision(6);
}

function stats(data) {
  let min = Infinity, max = -Infinity, sum = 0;
  for (const v of data) { min = Math.min(min, v); max = Math.max(max, v); sum += v; }
  return [min, max, data.length ? sum / data.length : NaN];
}

function row(cells) {
  const tr = document.createElement('tr');
  for (const c of cells) {
    const td = document.createElement('td');
    if (c instanceof Node) td.append(c); else td.textContent = c;
    tr.append(td);
  }
  return tr;
}

function signatureSpec() {
  return current.signatures[$('signature').value];
}

function showInputs() {
  const body = $('inputs').querySelector('tbody');
  body.replaceChildren();
  for (const inp of signatureSpec().inputs) {
    const picker = document.createElement('input');
    picker.type = 'file';
    picker.accept = '.npy';
    picker.addEventListener('change', async () => {
      try {
        given[inp.name] = npyToInput(parseNpy(await picker.files[0].arrayBuffer()), inp);
        setStatus(`${inp.name}: loaded ${picker.files[0].name}`);
      } catch (e) {
        picker.value = '';
        setStatus(String(e.message ?? e), true);
      }
    });
    const label = document.createElement('span');
    label.textContent = given[inp.name] ? 'given ' : 'random ';
    const cell = document.createElement('span');
    cell.append(label, picker);
    body.append(row([inp.name, inp.dtype, `[${inp.shape.join(', ')}]`, cell]));
  }
}

function showResult(result, timings) {
  const body = $('outputs').querySelector('tbody');
  body.replaceChildren();
  for (const [name, out] of Object.entries(result.outputs)) {
    const [min, max, mean] = stats(out.data);
    const first = Array.from(out.data.slice(0, 6), fmt).join(', ') + (out.data.length > 6 ? ', …' : '');
    body.append(row([name, out.dtype, `[${out.shape.join(', ')}]`, fmt(min), fmt(max), fmt(mean), first]));
  }
  const t = $('timings').querySelector('tbody');
  t.replaceChildren();
  for (const [what, ms] of Object.entries(timings)) t.append(row([what, Number.isFinite(ms) ? `${ms.toFixed(2)} ms` : '–']));
}

async function selectModel(url) {
  setStatus(`loading ${url}…`);
  $('run').disabled = true;
  current = null;
  current = await getModel(url);
  given = {};
  const sel = $('signature');
  sel.replaceChildren(...Object.keys(current.signatures).map((k) => new Option(k, k)));
  sel.value = current.defaultSignature;
  $('model-info').textContent = `${(current.bytes / 1024).toFixed(1)} KB, on ${current.accelerator.where}`;
  if (url === '/models/' + firstModelName) await loadGivenInputs();
  showInputs();
  $('run').disabled = false;
  setStatus(`${url} compiled in ${current.timings.compileMs.toFixed(1)} ms (${current.accelerator.text})`);
}

async function loadGivenInputs() {
  const list = await (await fetch('/inputs.json')).json();
  const spec = signatureSpec();
  for (const {name, url} of list) {
    const inp = spec.inputs.find((i) => i.name === name);
    if (inp) given[name] = npyToInput(parseNpy(await (await fetch(url)).arrayBuffer()), inp);
  }
}

let lastRun = Promise.resolve();
let lastResult = null;  // the inputs and outputs of the last click on Run

async function runPage() {
  $('run').disabled = true;
  try {
    const spec = signatureSpec();
    const inputs = {...randomInputs(spec), ...given};
    const repeats = Math.max(0, Math.min(1000, Number($('repeats').value) || 0));
    const result = await runModel(current, inputs, {signature: $('signature').value, repeats});
    lastResult = {inputs, outputs: result.outputs};
    showResult(result, {'fetch model': current.timings.fetchMs,
                        [`compile (${current.accelerator.used})`]: current.timings.compileMs,
                        'first run': result.firstRunMs, [`median of ${repeats} runs`]: median(result.runMs)});
    const source = spec.inputs.every((i) => given[i.name]) ? 'given' : Object.keys(given).length ? 'given and random' : 'random';
    setStatus(`ran ${$('signature').value} on ${source} inputs (${current.accelerator.text})`);
  } catch (e) {
    setStatus(String(e.message ?? e), true);
  } finally {
    $('run').disabled = false;
  }
}

// ---- the scripting API ---------------------------------------------------------------------------

function encodeTensors(outputs) {
  return Object.fromEntries(Object.entries(outputs).map(([name, o]) =>
    [name, {dtype: o.dtype, shape: o.shape, b64: toBase64(o.data)}]));
}

function tableText(id) {
  return Array.from($(id).querySelectorAll('tbody tr'), (tr) => Array.from(tr.cells, (td) => td.textContent));
}

window.tte = {
  /** Clicks Run as a person would (the model the page shows); returns the status line and tables. */
  async clickRun({repeats = 3} = {}) {
    await started.catch(() => {});
    $('repeats').value = repeats;
    $('run').click();
    await lastRun;
    return {status: $('status').textContent, error: $('status').className === 'error',
            modelInfo: $('model-info').textContent, accelerator: current && acceleratorReport(current),
            outputs: tableText('outputs'), timings: tableText('timings'),
            data: lastResult && {inputs: encodeTensors(lastResult.inputs), outputs: encodeTensors(lastResult.outputs)}};
  },
  /** What the page found: {accelerator: its choice, webgpu: {available, adapter, reason}, build, threads}. */
  async webgpu() {
    await initLiteRt();
    return {accelerator: runtime.accelerator, webgpu: runtime.webgpu, build: runtime.build, threads: runtime.threads};
  },
  /** Loads (and caches) a model, URL or {model, accelerator?}; returns its signatures, size, load timings
   *  and the accelerator it runs on ({requested, used, fullyAccelerated, cpuOps, adapter, note, text}). */
  async load(args) {
    await started.catch(() => {});  // the page's own first load and run come first
    const {model, accelerator: acc = null} = typeof args === 'string' ? {model: args} : args;
    const m = await getModel(model, acc);
    return {signatures: m.signatures, defaultSignature: m.defaultSignature, bytes: m.bytes, threads: m.threads,
            timings: m.timings, accelerator: acceleratorReport(m)};
  },
  /** {model, accelerator?, signature?, inputs: {name: {dtype, shape, b64}}, repeats?} -> {outputs, timings,
   *  accelerator}; accelerator defaults to the page's choice (?accelerator=, else auto). */
  async run({model, accelerator: acc = null, signature = null, inputs, repeats = 0}) {
    await started.catch(() => {});
    const m = await getModel(model, acc);
    const decoded = Object.fromEntries(Object.entries(inputs).map(([name, t]) =>
      [name, {dtype: t.dtype, shape: t.shape, data: fromBase64(t.b64, t.dtype)}]));
    const r = await runModel(m, decoded, {signature, repeats});
    return {signature: r.signature, outputs: encodeTensors(r.outputs), accelerator: acceleratorReport(m),
            timings: {fetchMs: m.timings.fetchMs, compileMs: m.timings.compileMs, firstRunMs: r.firstRunMs,
                      medianRunMs: median(r.runMs), runs: r.runMs.length, threads: m.threads}};
  },
};

let firstModelName = null;

function showWebGpu() {
  const gpu = runtime.webgpu;
  $('webgpu').textContent = gpu.available ? `WebGPU: ${gpu.adapter}` : `WebGPU unavailable: ${gpu.reason}`;
  const acc = $('accelerator');
  acc.replaceChildren(...ACCELERATORS.map((a) => new Option(a, a)));
  acc.value = runtime.accelerator;
}

async function main() {
  await initLiteRt();
  showWebGpu();
  $('accelerator').addEventListener('change', () => {  // a reload: the choice decides which LiteRT.js build loads
    const url = new URL(location.href);
    url.searchParams.set('accelerator', $('accelerator').value);
    location.assign(url);
  });
  const models = await (await fetch('/models.json')).json();
  const sel = $('model');
  sel.replaceChildren(...models.map((m) => new Option(`${m.name} (${(m.bytes / 1024).toFixed(1)} KB)`, m.url)));
  sel.addEventListener('change', () => selectModel(sel.value).catch((e) => setStatus(String(e.message ?? e), true)));
  $('signature').addEventListener('change', () => { given = {}; showInputs(); });
  $('run').addEventListener('click', () => { lastRun = runPage(); });
  firstModelName = models[0]?.name;
  window.tteReady = true;
  if (models.length) {
    await selectModel(models[0].url);
    lastRun = runPage();  // show outputs and timings right away: given inputs, else random ones
    await lastRun;
  }
}

const started = main();
started.catch((e) => {
  window.tteReady = true;  // the API still reports errors per call
  setStatus(String(e.message ?? e), true);
});
